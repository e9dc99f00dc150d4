"""Test helpers: random HF weights, a single-process loader that follows an ``HFAdapter``'s
table, and an init check shared by the encoder and decoder tests."""

from __future__ import annotations

import fnmatch

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from torchtitan_omni.modules.init import init_context


def randomize_(module: nn.Module, seed: int = 0, std: float = 0.05) -> nn.Module:
    """Perturb every parameter, so that a wrong mapping of any bias or norm shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
    return module


def write_hf_checkpoint(module: nn.Module, path, prefix: str = "") -> None:
    """Save an HF module's state dict as safetensors, names under ``prefix`` (as on the hub)."""
    tensors = {prefix + k: v.detach().contiguous() for k, v in module.state_dict().items()}
    save_file(tensors, str(path))


def load_with_adapter(ours: nn.Module, adapter, path) -> tuple[set[str], set[str]]:
    """Fill ``ours`` from an HF safetensors file as the adapter's table says.

    Returns (our tensors without a source and not declared ``init_only``, HF tensors neither
    used nor ignored), both empty for a complete adapter.
    """
    hf = load_file(str(path))
    sources = adapter.sources()
    state = ours.state_dict()
    used = set()
    with torch.no_grad():
        for name, src in sources.items():
            if name not in state:
                raise AssertionError(f"the adapter maps {name}, which the module does not have")
            parts = [hf[k].t() if src.transpose else hf[k] for k in src.keys]
            value = parts[0] if src.stack_dim is None else torch.stack(parts, src.stack_dim)
            assert value.shape == state[name].shape, (name, value.shape, state[name].shape)
            state[name].copy_(value)
            used.update(src.keys)
    ignored = adapter.ignored_hf_keys()
    unused = {
        k for k in hf if k not in used and not any(fnmatch.fnmatchcase(k, p) for p in ignored)
    }
    init_only = adapter.init_only()
    missing = {
        n
        for n in set(state) - set(sources)
        if not any(fnmatch.fnmatchcase(n, p) for p in init_only)
    }
    return missing, unused


def check_init_covers_everything(module: nn.Module) -> None:
    """``init_weights`` must set every parameter (NaN-filled first) and be seed-reproducible."""
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(float("nan"))
    with init_context(module, seed=3):
        module.init_weights()
    bad = [n for n, p in module.named_parameters() if not torch.isfinite(p).all()]
    assert not bad, f"init_weights left these uninitialized: {bad[:5]}"
    first = {n: p.clone() for n, p in module.named_parameters()}
    with init_context(module, seed=3):
        module.init_weights()
    for n, p in module.named_parameters():
        assert torch.equal(first[n], p), f"{n} is not reproducible from the seed"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
