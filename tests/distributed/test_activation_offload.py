"""Activation offload: blocks whose saved tensors go to host memory (every tensor, by a zero
size threshold, so the copies happen on CPU too) give the same loss and gradients as without,
with and without activation checkpointing; parameters are never copied."""

from __future__ import annotations

import copy

import pytest
import torch

from torchtitan_omni.distributed import activation_offload as ao
from torchtitan_omni.distributed.activation_checkpoint import checkpoint_units
from torchtitan_omni.foundations.llama3 import Llama3, Llama3Args
from torchtitan_omni.modules.init import init_context
from torchtitan_omni.protocols.modules import AttentionMeta


@pytest.mark.parametrize("ac", ["none", "full"])
def test_offloaded_blocks_match(ac, monkeypatch):
    args = Llama3Args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                      ffn_hidden_dim=64, rope_scaling=None, max_seq_len=64)
    ref = Llama3(args)
    with init_context(ref, seed=0):
        ref.init_weights()
    model = copy.deepcopy(ref)
    units = list(model.layers.values())
    checkpoint_units(units, ac)
    assert ao.offload_activations(units, min_bytes=0) == 2
    packed = []  # (saved tensor, what was kept for it)
    real_pack = ao._pack
    monkeypatch.setattr(ao, "_pack",
                        lambda t, m: packed.append((t, real_pack(t, m))) or packed[-1][1])
    x = torch.randn(1, 24, 32)
    meta = AttentionMeta(torch.tensor([0, 10, 24], dtype=torch.int32), 14,
                         torch.cat([torch.arange(10), torch.arange(14)]).unsqueeze(0))
    outs = []
    for m in (ref, model):
        xi = x.clone().requires_grad_()
        out = m(xi, meta)
        out.square().sum().backward()
        outs.append((out, xi.grad, [p.grad for p in m.parameters()]))
    offloaded = [t for t, kept in packed if isinstance(kept, tuple)]
    assert offloaded, "nothing was offloaded"
    if ac == "full":  # only the two block inputs are kept, and both go to the host
        assert len(offloaded) == len(packed) == 2
    else:  # the weights the matmuls save stay as they are
        kept_params = [kept is t for t, kept in packed if isinstance(t, torch.nn.Parameter)]
        assert kept_params and all(kept_params)
    torch.testing.assert_close(outs[1][0], outs[0][0])
    torch.testing.assert_close(outs[1][1], outs[0][1])
    for g, r in zip(outs[1][2], outs[0][2]):
        torch.testing.assert_close(g, r)


def test_parameters_and_small_tensors_stay():
    w = torch.nn.Parameter(torch.randn(600, 600))
    assert ao._pack(w, 0) is w
    small = torch.randn(4)
    assert ao._pack(small, 1 << 20) is small
    big = torch.randn(512, 600)
    device, host = ao._pack(big, 1 << 20)
    assert device == big.device and torch.equal(ao._unpack((device, host)), big)
