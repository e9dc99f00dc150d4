"""``torchtitan_omni.checkpoint.tensor_readers``: a tensor asked for that no reader holds stops
the read with its name, instead of being left out of the result."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from torchtitan_omni.checkpoint.tensor_readers import ChainReader, HFPartReader
from torchtitan_omni.protocols.hf import HFSource


class _OneTensorAdapter:
    """The part's ``weight`` is the folder's ``w``, transposed (what ``sources()`` is read
    for; an ``HFAdapter`` gives more)."""

    def sources(self) -> dict[str, HFSource]:
        return {"weight": HFSource(("w",), transpose=True)}


@pytest.fixture
def reader(tmp_path) -> HFPartReader:
    save_file({"w": torch.arange(6.0).view(2, 3)}, str(tmp_path / "model.safetensors"))
    return HFPartReader("proj", str(tmp_path), _OneTensorAdapter())  # type: ignore[arg-type]


def test_hf_part_reader_reads_through_the_adapter_and_names_a_missing_tensor(reader):
    assert reader.meta("proj.weight") == ((3, 2), torch.float32)
    assert torch.equal(reader.read(["proj.weight"])["proj.weight"],
                       torch.arange(6.0).view(2, 3).t())
    assert reader.meta("proj.bias") is None
    with pytest.raises(KeyError, match=r"proj\.bias is not in"):
        reader.read(["proj.bias"])


def test_chain_reader_names_a_tensor_none_of_its_readers_holds(reader):
    chain = ChainReader([reader])
    assert list(chain.read(["proj.weight"])) == ["proj.weight"]
    with pytest.raises(KeyError, match=r"proj\.bias is not in"):
        chain.read(["proj.weight", "proj.bias"])
