"""Single-process conversion between our state dicts and HF checkpoints through an adapter.

Test-only: applies each ``HFSource`` literally (one key, or keys stacked along ``stack_dim``,
optionally transposed). The sharded loader and the exporter live in ``torchtitan_omni.checkpoint``.
"""

from __future__ import annotations

import fnmatch

import torch

from torchtitan_omni.protocols.hf import HFAdapter


def hf_to_ours(adapter: HFAdapter, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our tensors built from an HF state dict; every HF key must be used or ignored."""
    out, used = {}, set()
    for name, src in adapter.sources().items():
        tensors = []
        for key in src.keys:
            t = hf_state[key]
            tensors.append(t.transpose(0, 1) if src.transpose else t)
            used.add(key)
        out[name] = tensors[0] if src.stack_dim is None else torch.stack(tensors, dim=src.stack_dim)
    unused = [k for k in hf_state if k not in used
              and not any(fnmatch.fnmatchcase(k, p) for p in adapter.ignored_hf_keys())]
    assert not unused, f"HF keys not mapped: {unused}"
    return out


def ours_to_hf(adapter: HFAdapter, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors split from our state dict (the exporter's direction)."""
    out = {}
    for name, src in adapter.sources().items():
        t = state[name]
        parts = [t] if src.stack_dim is None else list(t.unbind(src.stack_dim))
        assert len(parts) == len(src.keys), name
        for key, part in zip(src.keys, parts):
            out[key] = part.transpose(0, 1) if src.transpose else part
    return out
