"""Float8 through TorchTitan's converter: only the foundation's block linears are swapped
(the text head, encoders, decoders and the frozen VQ stay as they are), and an emulated
float8 forward/backward of the debug model runs (torchao needed; skipped without it)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import torchtitan_omni.models  # noqa: F401  (registers the specs)
from tests.harness import REPO
from tests.models.batches import mixed_batch
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan_omni.components.quantization import OMNI_FLOAT8_FILTERS, add_omni_float8_filters
from torchtitan_omni.config.manager import parse_job_config
from torchtitan_omni.modules.linear_cross_entropy import LinearHead


@pytest.fixture
def float8_allowed(monkeypatch):
    """Start-up checks as on a Hopper GPU (float8 is refused on CPU runs), torchao faked when
    it is not installed (only its presence is checked at start-up)."""
    from torchtitan_omni.config import values

    monkeypatch.setattr(values.platform, "is_cpu", lambda: False)
    monkeypatch.setattr(values, "cuda_capability", lambda: (9, 0))
    try:
        import torchao  # noqa: F401
    except ImportError:
        monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))


def _job(*extra):
    return parse_job_config(
        ["--job.config_file", str(REPO / "train_configs" / "llama_omni_debug.toml"), *extra]
    )


def test_filters_are_added_only_with_float8(float8_allowed):
    assert add_omni_float8_filters(_job()) == []
    job = _job("--model.converters", "float8", "--quantize.linear.float8.filter_fqns", "w2")
    assert add_omni_float8_filters(job) == ["w2", *OMNI_FLOAT8_FILTERS]
    assert add_omni_float8_filters(job) == ["w2", *OMNI_FLOAT8_FILTERS]  # idempotent


def test_converter_swaps_only_foundation_blocks(float8_allowed):
    pytest.importorskip("torchao.float8")
    from torchtitan.components.quantization.float8 import Float8LinearConverter

    job = _job("--model.converters", "float8", "--quantize.linear.float8.emulate")
    add_omni_float8_filters(job)
    spec = get_train_spec("llama_omni")
    args = spec.model_args["debugmodel"]
    model = spec.model_cls(args)

    class Dims:
        dp_shard_enabled = False

    Float8LinearConverter(job, Dims()).convert(model)
    swapped = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    linears = [n for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n.startswith("llm.layers.")]
    assert swapped and sorted(swapped) == sorted(linears)
    assert type(model.llm.output) is LinearHead
    model.init_weights()
    batch, labels = mixed_batch(model, args.llm_args.vocab_size)
    from tests.models.test_debug_flavors import _forward

    loss, _ = _forward(model, batch, labels)
    loss.backward()
    assert torch.isfinite(loss)
    assert model.llm.layers["0"].attention.wq.weight.grad is not None
