"""Activation checkpointing of encoder blocks with the small-call exemption
(``omni.encoder_checkpoint_min_tokens``): which calls recompute, and that the results do not
depend on it (one process, float32)."""

from __future__ import annotations

import copy

import pytest
import torch

from torchtitan_omni.distributed.activation_checkpoint import checkpoint_units, is_checkpointed
from torchtitan_omni.encoders.vision import VisionArgs, VisionEncoder
from torchtitan_omni.modules.init import init_context

MIN_ROWS = 40


def _encoder() -> VisionEncoder:
    enc = VisionEncoder(VisionArgs.debug(), llm_dim=32)
    with init_context(enc):
        enc.init_weights()
    return enc


def _media(items: int) -> dict[str, torch.Tensor]:
    """``items`` images of 2 x 2 merge windows (16 patches each)."""
    args = VisionArgs.debug()
    grid = torch.tensor([[1, 4, 4]] * items)
    g = torch.Generator().manual_seed(items)
    return {"patches": torch.randn(16 * items, args.patch_dim, generator=g), "grid_thw": grid}


def _fc1_calls(enc: VisionEncoder) -> list[int]:
    """A counter of the blocks' first MLP linear calls; a recompute calls it once more."""
    calls = [0]

    def count(*_):
        calls[0] += 1

    for block in enc.blocks:
        block.mlp.fc1.register_forward_hook(count)
    return calls


def _step(enc: VisionEncoder, media) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    enc.zero_grad()
    out = enc.lm_encode(media, "image")
    (out.square().sum()).backward()
    return out.detach(), {n: p.grad.clone() for n, p in enc.named_parameters()}


@pytest.mark.parametrize("items", [2, 3])  # 32 rows (under MIN_ROWS), 48 rows (over)
def test_small_calls_run_unchecked_and_results_do_not_change(items):
    reference = _encoder()
    checked = copy.deepcopy(reference)
    depth = len(checked.blocks)
    assert checkpoint_units(list(checked.blocks), "full", min_rows=MIN_ROWS) == depth
    assert all(is_checkpointed(b) for b in checked.blocks)
    calls = _fc1_calls(checked)
    media = _media(items)
    out, grads = _step(checked, media)
    recomputed = 16 * items >= MIN_ROWS
    # forward once per block, plus the recompute of every block in the backward when checked
    assert calls[0] == depth * (2 if recomputed else 1), (items, calls[0])
    ref_out, ref_grads = _step(reference, media)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_without_a_threshold_every_call_is_checkpointed():
    enc = _encoder()
    checkpoint_units(list(enc.blocks), "full")
    calls = _fc1_calls(enc)
    _step(enc, _media(1))  # 16 rows
    assert calls[0] == 2 * len(enc.blocks)


def test_compiled_blocks_with_the_exemption_match_eager():
    """Checkpointed, then compiled (as ``parallelize`` orders them): calls on both sides of the
    threshold give the unchecked eager encoder's outputs and gradients."""
    from torchtitan_omni.distributed.compile import compile_units

    torch._dynamo.reset()
    reference = _encoder()
    compiled = copy.deepcopy(reference)
    checkpoint_units(list(compiled.blocks), "full", min_rows=MIN_ROWS)
    compile_units(list(compiled.blocks), "inductor")
    for items in (2, 3, 2):  # 32 rows, 48 rows, 32 again
        media = _media(items)
        out, grads = _step(compiled, media)
        ref_out, ref_grads = _step(reference, media)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


class _Exchanging(torch.nn.Module):
    """A linear, Ulysses' all-to-all (heads scattered, sequence gathered), a GELU and a second
    linear: what a Ulysses attention block does around its exchanges."""

    def __init__(self, group) -> None:
        super().__init__()
        self.group = group
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(4, 8)  # half the heads (2 ranks) after the exchange

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchtitan_omni.distributed.comm import all_to_all

        h = self.a(x).unflatten(-1, (4, 2))  # (batch, seq, heads, head_dim)
        h = all_to_all(h, 2, 1, self.group)
        return self.b(torch.nn.functional.gelu(h.flatten(2)))


def _exchanges_in_backward(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from tests.test_float8 import calls_in_backward
    from torchtitan_omni.distributed import activation_checkpoint as ac

    keeping, recomputing = (_Exchanging(dist.group.WORLD) for _ in range(2))
    recomputing.load_state_dict(keeping.state_dict())
    ac.checkpoint_units([keeping], "selective", "op")
    x = torch.randn(1, 6, 8, generator=torch.Generator().manual_seed(rank))
    ops = (torch.ops._c10d_functional.all_to_all_single.default,)
    kept, grad = calls_in_backward(keeping, x, *ops)
    ac._SAVE_OPS.discard("all_to_all_single")  # the policy before all-to-alls were kept
    ac.checkpoint_units([recomputing], "selective", "op")
    again, grad_again = calls_in_backward(recomputing, x, *ops)
    return {"kept": kept, "again": again, "same_grad": torch.equal(grad, grad_again)}


def test_per_op_checkpointing_keeps_the_all_to_all_results():
    """Per-op selective AC keeps what an all-to-all received: the backward runs only the
    gradient's exchange, not the forward's again in the recompute; gradients are the same
    either way (2 gloo ranks)."""
    from tests.harness import run_distributed

    for result in run_distributed(_exchanges_in_backward, 2):
        assert result["kept"] == 1 and result["again"] == 2, result
        assert result["same_grad"], result


class _AttentionBlock(torch.nn.Module):
    """A projection, causal attention (CPU's flash kernel) and an output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)  # 3 x [B, H, S, D]
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).flatten(2))


@pytest.mark.parametrize("option, attention_again, projections_again", [
    ("full", 1, 1), ("op", 0, 0), ("attention", 0, 1)])
def test_attention_option_keeps_the_attention_and_recomputes_the_rest(
        option, attention_again, projections_again):
    """``selective_ac_option = "attention"`` keeps the attention kernel's outputs (the backward
    does not run it again) and recomputes the projections, where "op" keeps both and full AC
    neither; the input's gradient is the same in every mode (one process, float32)."""
    from tests.test_float8 import calls_in_backward

    torch.manual_seed(0)
    reference = _AttentionBlock()
    block = copy.deepcopy(reference)
    mode = ("full", "1") if option == "full" else ("selective", option)
    assert checkpoint_units([block], *mode) == 1
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(1))
    attention = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,)
    again, grad = calls_in_backward(block, x, *attention)
    assert again == attention_again
    # the projections' forward matmuls are addmm (the backward's own are mm); the recompute
    # stops once it has what the backward needs: q, k and v, not the output projection
    projections, _ = calls_in_backward(copy.deepcopy(block), x, torch.ops.aten.addmm.default)
    assert projections == projections_again
    _, reference_grad = calls_in_backward(reference, x, *attention)
    torch.testing.assert_close(grad, reference_grad, rtol=0, atol=0)
