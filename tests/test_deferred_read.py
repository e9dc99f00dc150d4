"""``components.deferred_read``: a log step's device values read on the host later (the GPU
side, that the host does not wait, is in ``test_gpu_fast_paths.py``)."""

import torch


def test_deferred_read_gives_back_names_shapes_and_exact_counts():
    """On CPU the copy is the read: each value comes back under its name, in its shape, as
    float64 (counts up to 2**53 exactly)."""
    from torchtitan_omni.components.deferred_read import DeferredRead

    big = 2**40 + 1
    read = DeferredRead({"loss": torch.tensor([0.5]), "loads": torch.tensor([[big, 2], [3, 4]]),
                         "norm": torch.tensor(7.0)})
    got = read.result()
    assert list(got) == ["loss", "loads", "norm"]
    assert got["loss"].tolist() == [0.5] and got["norm"].shape == ()
    assert got["loads"].shape == (2, 2) and int(got["loads"][0, 0]) == big
    assert read.done()
