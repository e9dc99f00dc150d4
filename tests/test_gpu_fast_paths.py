"""The fast paths on a CUDA GPU in bf16 against float64 CPU references: whole-row attention
(cuDNN/flash SDPA) for single-document rows, packed attention on FlashAttention-2's varlen
kernels (and per-op checkpointing keeping its output), the chunked text-head loss, and a compiled
Llama block and a compiled Qwen3-MoE block with capacity-padded dispatch (one graph each, per-op
activation checkpointing inside) against the eager blocks; float8 block linears (TorchTitan's
converter, torch's float8 matmuls) near bf16; the fused AdamW step taking the clipping
coefficient against clipping first. Skipped without a GPU."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F

from torchtitan_omni.modules.attention import row_attention, varlen_attention
from torchtitan_omni.modules.linear_cross_entropy import linear_cross_entropy
from torchtitan_omni.protocols.modules import AttentionMeta

pytestmark = pytest.mark.gpu
BF16_REL = 2e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm())


def test_row_attention_matches_per_document_reference():
    g = torch.Generator().manual_seed(0)
    s, real = 1024, 1000  # one document, then padding
    q = torch.randn(1, s, 8, 64, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, s, 2, 64, generator=g, dtype=torch.float64) for _ in range(2))
    cu = torch.tensor([0, real, s], dtype=torch.int32)
    ref = varlen_attention(q[0], k[0], v[0], cu, real, causal=True)[:real]
    out = row_attention(*(t.cuda().bfloat16() for t in (q, k, v)), causal=True)[0, :real]
    assert _rel(out, ref) < BF16_REL


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_attention_matches_per_document_reference(causal):
    """The FlashAttention-2 varlen path (``flash_varlen``), grouped queries included: output
    and the gradients of q, k and v (k/v keep their 2 heads) against float64 per document."""
    g = torch.Generator().manual_seed(2)
    docs = [300, 1, 700, 23]
    t = sum(docs)
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(t, 8, 64, generator=g, dtype=torch.float64)
    k, v = (torch.randn(t, 2, 64, generator=g, dtype=torch.float64) for _ in range(2))
    grad = torch.randn(t, 8, 64, generator=g, dtype=torch.float64)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = varlen_attention(*ref_in, cu, max(docs), causal=causal, scale=0.1)
    ref.backward(grad)
    gpu_in = [x.cuda().bfloat16().requires_grad_() for x in (q, k, v)]
    out = varlen_attention(*gpu_in, cu.cuda(), max(docs), causal=causal, scale=0.1)
    out.backward(grad.cuda().bfloat16())
    assert _rel(out, ref) < BF16_REL
    for got, want in zip(gpu_in, ref_in):
        assert got.grad.shape == want.grad.shape
        assert _rel(got.grad, want.grad) < BF16_REL


def test_per_op_checkpoint_saves_the_varlen_attention():
    """Per-op activation checkpointing keeps the attention's output: the flash forward kernel
    runs once per forward + backward of a checkpointed call, not again in the recompute."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from torchtitan_omni.distributed.activation_checkpoint import checkpoint_units
    from torchtitan_omni.modules.attention import SelfAttention

    class CountFlash(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ == "flash_varlen":
                CountFlash.calls += 1
            return func(*args, **(kwargs or {}))

    attn = SelfAttention(256, 4, 2).cuda().bfloat16()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.02)
    checkpoint_units([attn], "selective", "op")
    docs = [500, 524]
    cu = torch.tensor([0, 500, 1024], dtype=torch.int32, device="cuda")
    pos = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0).cuda()
    x = torch.randn(1, 1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with CountFlash():
        attn(x, AttentionMeta(cu, max(docs), pos)).float().square().mean().backward()
    assert x.grad is not None
    assert CountFlash.calls == 1, f"the flash forward ran {CountFlash.calls} times"


def test_chunked_loss_matches_reference():
    g = torch.Generator().manual_seed(1)
    n, d, vocab = 3000, 256, 50000
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, d, generator=g, dtype=torch.float64) * 0.05
    t = torch.randint(0, vocab, (n,), generator=g)
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    F.cross_entropy(hr @ wr.t(), t, reduction="sum").backward()
    hc, wc = (x.cuda().bfloat16().requires_grad_() for x in (h, w))
    loss = linear_cross_entropy(hc, wc, t.cuda(), rows=512)
    loss.backward()
    ref = F.cross_entropy(h @ w.t(), t, reduction="sum")
    assert abs(float(loss) - float(ref)) / float(ref) < 1e-2
    assert _rel(hc.grad, hr.grad) < BF16_REL and _rel(wc.grad, wr.grad) < BF16_REL


def _small_llama() -> torch.nn.Module:
    """A 2-layer Llama-3 foundation (dim 256) in bf16 on the GPU."""
    from torchtitan_omni.foundations.llama3 import Llama3, Llama3Args
    from torchtitan_omni.modules.init import init_context

    args = Llama3Args(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512,
                      ffn_hidden_dim=512, rope_scaling=None, max_seq_len=4096)
    model = Llama3(args)
    with init_context(model, seed=0):
        model.init_weights(torch.device("cuda"))
    return model.cuda().bfloat16()


def _run_both(reference: torch.nn.Module, other: torch.nn.Module,
              docs: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each model's output and input gradient on one packed row of ``docs`` (the same random
    input, a random projection of the output as the loss)."""
    s = sum(docs)
    x = torch.randn(1, s, 256, device="cuda", dtype=torch.bfloat16)
    # a random projection: the model ends in an RMSNorm (unit weight), whose output's mean
    # square is constant, so its input gradient would be rounding noise (norm 4e-8)
    g = torch.randn(1, s, 256, device="cuda")
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0).cuda()
    meta = AttentionMeta(cu.cuda(), max(docs), pos)
    outs = []
    for model in (reference, other):
        xi = x.clone().requires_grad_()
        out = model(xi, meta)
        (out.float() * g).sum().backward()
        outs.append((out, xi.grad))
    return outs


def _relative_errors(reference: torch.nn.Module, other: torch.nn.Module,
                     docs: list[int]) -> tuple[float, float]:
    """Relative difference of ``other``'s output and input gradient from ``reference``'s
    (:func:`_run_both`)."""
    (out, grad), (out_other, grad_other) = _run_both(reference, other, docs)
    return _rel(out_other, out), _rel(grad_other, grad)


def test_compiled_block_matches_eager_block():
    from torchtitan_omni.distributed.activation_checkpoint import checkpoint_units
    from torchtitan_omni.distributed.compile import compile_units

    eager = _small_llama()
    compiled = copy.deepcopy(eager)
    units = list(compiled.layers.values())
    checkpoint_units(units, "selective", "op")
    compile_units(units, "inductor")
    for docs in ([600, 424], [1536], [100, 1000, 180]):
        errors = _relative_errors(eager, compiled, docs)
        assert errors[0] < BF16_REL and errors[1] < 5e-2, (docs, errors)


def test_compiled_moe_block_with_capacity_dispatch_matches_eager():
    from torchtitan_omni.distributed.activation_checkpoint import checkpoint_units
    from tests.distributed.common import qwen3_moe_foundation
    from torchtitan_omni.distributed.compile import compile_units
    from torchtitan_omni.modules.moe_capacity import CapacityDispatcher

    eager = qwen3_moe_foundation(256, 2, experts=16, top_k=4, device="cuda",
                                 dtype=torch.bfloat16)
    for layer in eager.layers.values():
        # C = 1024 x 4 / 16 = 256 slots per expert: the 1536-token batch must drop copies
        layer.moe.dispatcher = CapacityDispatcher(16, 4, 1.0, tokens=1024)
    compiled = copy.deepcopy(eager)
    units = list(compiled.layers.values())
    assert all(u.compile_fullgraph for u in units)
    checkpoint_units(units, "selective", "op")
    compile_units(units, "inductor")
    total_dropped = 0
    for docs in ([600, 424], [1536], [100, 1000, 180]):
        outs = _run_both(eager, compiled, docs)
        assert _rel(outs[1][0], outs[0][0]) < BF16_REL
        assert _rel(outs[1][1], outs[0][1]) < 5e-2
        # bf16 routing of near-tied experts may differ between the two: drops within 1%
        counts = [model.moe_counts() for model in (eager, compiled)]
        dropped = [int(c[1].sum()) for c in counts]
        assert abs(dropped[0] - dropped[1]) <= 0.01 * int(counts[0][0].sum()), dropped
        total_dropped += dropped[0]
    assert total_dropped > 0, "the capacity never bound: nothing was tested"


@pytest.fixture
def float8_gpu(monkeypatch):
    """A GPU with float8 matmuls and torchao, else skipped; the jobs these tests parse are
    checked at start-up as GPU jobs (conftest makes CPU the device of the test process, and
    float8 is refused on CPU runs)."""
    from torchtitan_omni.config import values

    pytest.importorskip("torchao.float8")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability >= 8.9")
    monkeypatch.setattr(values.platform, "is_cpu", lambda: False)


def _float8_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` converted as the trainer converts it (real float8 matmuls)."""
    from tests.test_float8 import convert_as_trainer

    return convert_as_trainer(copy.deepcopy(model))


def test_float8_foundation_matches_bf16(float8_gpu):
    """TorchTitan's float8 converter as the trainer applies it (either name, the omni filters):
    on a Hopper GPU the block linears run torch's float8 matmuls (not emulated), and the
    foundation's output and input gradient stay near the bf16 model's (tensorwise e4m3/e5m2
    scaling: a few percent, not bit equality)."""
    plain = _small_llama()
    fp8 = _float8_copy(plain)
    swapped = {n: m for n, m in fp8.named_modules() if type(m).__name__ == "Float8Linear"}
    assert len([n for n in swapped if n.startswith("layers.")]) == 2 * 7  # q k v o, w1 w2 w3
    assert not any(m.config.emulate for m in swapped.values())
    errors = _relative_errors(plain, fp8, [600, 424])
    assert 0 < errors[0] < 0.1 and 0 < errors[1] < 0.2, errors


def test_compiled_float8_blocks_match_eager_float8(float8_gpu):
    """The benchmark points' float8 setting: float8 blocks checkpointed per op and compiled
    (inductor) against the same float8 blocks eager."""
    from torchtitan_omni.distributed.activation_checkpoint import checkpoint_units
    from torchtitan_omni.distributed.compile import compile_units

    eager = _float8_copy(_small_llama())
    compiled = copy.deepcopy(eager)
    units = list(compiled.layers.values())
    checkpoint_units(units, "selective", "op")
    compile_units(units, "inductor")
    for docs in ([600, 424], [1536]):
        errors = _relative_errors(eager, compiled, docs)
        assert errors[0] < 5e-2 and errors[1] < 1e-1, (docs, errors)


def test_per_op_checkpointing_keeps_float8_matmuls(float8_gpu):
    """Under per-op AC a float8 linear's forward matmul is kept, not run again in the
    backward: the backward runs two per linear (input and weight gradients), three if the
    recompute repeated the forward's. (Eager, a dispatch mode sees the float8 tensors' ``mm``;
    traced for compile, torch's ``_scaled_mm``: the policy keeps both.)"""
    from tests.test_float8 import calls_in_backward, float8_block
    from torchtitan_omni.distributed.activation_checkpoint import checkpoint_units

    block = float8_block(emulate=False).cuda().bfloat16()
    plain = copy.deepcopy(block)
    checkpoint_units([block], "selective", "op")
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    ops = (torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default)
    calls, grad = calls_in_backward(block, x, *ops)
    assert calls == 2 * 2, calls
    _, grad_plain = calls_in_backward(plain, x, *ops)
    assert _rel(grad, grad_plain) < 1e-3


def test_compiled_float8_vision_tower_on_any_patch_count(float8_gpu):
    """``omni.float8_encoders``: the debug model's vision tower converted as the trainer
    converts it (real float8 matmuls), its blocks checkpointed per op and compiled, over
    patch counts that are not multiples of 16 (the weight gradients' float8 matmuls run over
    the patches; 11,048 failed there before they were padded): output and patch gradients
    near the bf16 tower's."""
    from tests.test_float8 import convert_as_trainer
    from torchtitan.protocols.train_spec import get_train_spec
    from torchtitan_omni.distributed.activation_checkpoint import checkpoint_units
    from torchtitan_omni.distributed.compile import compile_units
    from torchtitan_omni.modules.init import init_context

    spec = get_train_spec("llama_omni")
    model = spec.model_cls(spec.model_args["debugmodel"])
    with init_context(model, seed=0):
        model.init_weights(torch.device("cuda"))
    model = model.cuda().bfloat16()
    plain = model.encoders["vision"]
    tower = convert_as_trainer(copy.deepcopy(model), "--omni.float8_encoders").encoders["vision"]
    assert sum(type(m).__name__ == "Float8Linear" for m in tower.modules()) > 0
    units = list(tower.blocks)
    checkpoint_units(units, "selective", "op")
    compile_units(units, "inductor")
    g = torch.Generator().manual_seed(0)
    for grid in ([[1, 2, 6]], [[1, 4, 10], [1, 6, 6]], [[1, 8, 12]]):  # 12, 76, 96 patches
        n = sum(t * h * w for t, h, w in grid)
        patches = torch.randn(n, plain.args.patch_dim, generator=g).cuda().bfloat16()
        outs = []
        for encoder in (plain, tower):
            x = patches.clone().requires_grad_()
            out = encoder.lm_encode({"patches": x, "grid_thw": torch.tensor(grid)}, "image")
            out.float().square().sum().backward()
            outs.append((out, x.grad))
        assert _rel(outs[1][0], outs[0][0]) < 0.1, grid
        assert _rel(outs[1][1], outs[0][1]) < 0.2, grid


def test_deferred_read_does_not_wait_for_the_gpu():
    """A log step's values are copied behind the queued kernels without the host waiting for
    them: right after the read starts, the GPU is still busy (a long sleep kernel queued
    first); its result then holds the values, names and shapes given."""
    from torchtitan_omni.components.deferred_read import DeferredRead

    parts = torch.tensor([1.5, -2.25], device="cuda")
    counts = torch.arange(6, device="cuda").view(2, 3)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time, on any recent GPU
    read = DeferredRead({"parts": parts, "counts": counts})
    assert not read.done()  # the copy waits behind the sleep; the host did not
    got = read.result()
    assert read.done() and got["parts"].tolist() == [1.5, -2.25]
    assert got["counts"].shape == (2, 3) and got["counts"].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_a_deferred_lines_window_covers_the_gpus_time():
    """The window between two log steps' reads is timed on the GPU's clock: with a long sleep
    kernel queued between them, the host closes the second window at once, yet the window
    covers the sleep."""
    from torchtitan_omni.components.deferred_read import DeferredRead
    from torchtitan_omni.components.metrics import LogWindow

    value = torch.ones(1, device="cuda")
    first = DeferredRead({"v": value})
    torch.cuda._sleep(1_000_000_000)  # about half a second of GPU time, on any recent GPU
    second = DeferredRead({"v": value})
    host = time.perf_counter()
    window = LogWindow(1, 0.0, host, host, start_mark=first.mark, end_mark=second.mark)
    assert not second.done()  # the host got here long before the GPU
    assert window.seconds() > 0.1
    assert second.done() and first.mark.elapsed_time(second.mark) > 100



def _clipped_steps_against_clipping_first(compile_min_numel: int | None = None,
                                          schedule: bool = False) -> tuple[float, float, list]:
    """``LocalShardAdamW`` (fused, CUDA) with the clipping coefficient taken into its step
    against clipping first and torch's fused AdamW, over two clipped steps and one unclipped,
    on a small MLP: the parameters' movement's relative difference and size, and the elements
    the compiled update took each step (``compile_min_numel``: its size bound, None for
    off; ``schedule``: a new learning rate each step). The gradients after the first step are
    checked here: those of torch's fused kernel clipped, to float32 rounding, and those of the
    compiled update as they were (it only reads them)."""
    from torchtitan_omni.components.optimizer import LocalShardAdamW, clip_gradients_
    from torchtitan_omni.distributed.utils import clip_grad_norm_

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.GELU(),
                               torch.nn.Linear(48, 8)).cuda()
    start = [p.detach().clone() for p in base.parameters()]
    kwargs = {"lr": 0.05, "betas": (0.8, 0.95), "weight_decay": 0.1, "fused": True}
    ours_model, ref_model = base, copy.deepcopy(base)
    ours = LocalShardAdamW(ours_model.parameters(), **kwargs)
    if compile_min_numel is not None:
        ours.compile_updates(min_numel=compile_min_numel)
    ref = torch.optim.AdamW(ref_model.parameters(), **kwargs)
    x = torch.randn(3, 16, 64, device="cuda")
    compiled = []
    for step in range(3):
        for model, opt in ((ours_model, ours), (ref_model, ref)):
            opt.zero_grad()
            model(x[step]).square().sum().backward()
            if opt is ours:
                given = [p.grad.clone() for p in model.parameters()]
            if schedule:
                opt.param_groups[0]["lr"] = 0.05 / (step + 1)
            if step < 2 and opt is ours:
                clip_gradients_([ours], list(model.parameters()), 1e-2)
            elif step < 2:
                assert float(clip_grad_norm_(list(model.parameters()), 1e-2)) > 1e-2
            opt.step()
        compiled.append(ours.compiled_numel)
        if step == 0:
            for a, b, g in zip(ours_model.parameters(), ref_model.parameters(), given):
                if compile_min_numel is not None and a.numel() >= compile_min_numel:
                    assert torch.equal(a.grad, g)
                else:
                    assert _rel(a.grad, b.grad) < 1e-6
    moved = [(a.detach() - s, b.detach() - s)
             for a, b, s in zip(ours_model.parameters(), ref_model.parameters(), start)]
    diff = sum(float((a - b).square().sum()) for a, b in moved) ** 0.5
    total = sum(float(b.square().sum()) for _, b in moved) ** 0.5
    return diff / total, total, compiled


def test_clipping_inside_the_fused_cuda_step_matches_clipping_first():
    """The CUDA fused AdamW with the clipping coefficient taken into its step (its kernel
    divides each float32 gradient by the inverse) against clipping first: the clipped gradients
    equal to float32 rounding, the parameters' movement within 1e-3 (Adam's moments amplify
    rounding where steps' gradients cancel: up to 1.3e-5 on CPU; 0.3-0.6 with the coefficient
    un-inverted or left over into the unclipped step)."""
    relative, total, compiled = _clipped_steps_against_clipping_first()
    assert total > 0.05 and relative < 1e-3, (relative, total)
    assert compiled == [0, 0, 0]


def test_compiled_update_on_cuda_matches_torch_fused_adamw():
    """``compile.components`` "optimizer" on CUDA: the weights' update compiled (Triton), the
    biases' by torch's fused kernel, the clipping coefficient inside the step, a changing
    learning rate; against clipping first and torch's fused AdamW, within the same bounds as
    the test above."""
    # both weights (3,072 and 384 elements), no bias
    relative, total, compiled = _clipped_steps_against_clipping_first(384, schedule=True)
    assert total > 0.05 and relative < 1e-3, (relative, total)
    assert compiled == [3072 + 384] * 3


def _expert_steps_on_cuda(copies_kept: bool, gradients: bool = False
                          ) -> tuple[list[torch.Tensor], list[float], list[bool]]:
    from torchtitan_omni.components.compute_copies import keep_expert_compute_copies
    from torchtitan_omni.components.optimizer import (
        LocalShardAdamW,
        clip_gradients_,
        keep_compute_copies,
    )
    from torchtitan_omni.modules.moe import EXPERT_WEIGHTS, GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(256, 128, 8).cuda()  # float32 weights
    with torch.no_grad():
        for which in EXPERT_WEIGHTS:
            getattr(experts, which).normal_(0, 0.05)
    experts.compute_dtype = torch.bfloat16  # as outside FSDP: grouped GEMM in bf16
    # a float32 parameter with a float32 gradient among the experts' (in one clipping group)
    gate = torch.nn.Parameter(torch.linspace(0.5, 1.5, 256, device="cuda"))
    order = [experts.w1, gate, experts.w2, experts.w3]
    opt = LocalShardAdamW(order, lr=1e-3, fused=True)
    opt.compile_updates(min_numel=8 * 256 * 128)
    copies = None
    if copies_kept:
        copies = keep_expert_compute_copies([experts], None, gradients=gradients)
        keep_compute_copies([opt], copies.copies)
        copies.refresh()
    counts = torch.tensor([0, 7, 1, 33, 0, 130, 5, 80], device="cuda")
    norms, fresh = [], []
    for step in range(3):
        opt.zero_grad()
        g = torch.Generator(device="cuda").manual_seed(step)
        x = torch.randn(int(counts.sum()), 256, device="cuda", generator=g, dtype=torch.bfloat16)
        experts((x.float() * gate).bfloat16(), counts).float().square().sum().backward()
        norms.append(float(clip_gradients_([opt], order, 1e-3)))
        opt.step()
        if copies is not None:
            fresh.append(all(torch.equal(c, p.detach().to(torch.bfloat16))
                             for p, c in copies.copies.items()))
    return [p.detach().clone() for p in order], norms, fresh


@pytest.mark.parametrize("gradients", [False, True], ids=["float32-gradients", "bf16-gradients"])
def test_expert_compute_copies_on_cuda_match_casting_each_pass(gradients):
    """``parallelism.expert_compute_copies`` on CUDA: float32 experts computing in bf16 by
    grouped GEMM, the update compiled with the bf16 copies written in its kernel, the gradients
    clipped (with a float32 parameter's among them); with ``gradients`` the copies hold the
    experts' bf16 gradients (read by the update and the clipping norm in float32). Three
    steps give the norms of three steps casting the weights in every pass bit for bit, and
    with bf16 gradients their weights within one unit in the last place, or 1e-9 (a few
    units of a step of ``lr = 1e-3``) where they are small: the update's kernel for bf16
    gradients is another kernel than for float32 ones, and inductor's code for a fixed size
    rounds the step of about 0.4% of the elements differently (at most one unit, or 3.5e-10,
    measured on an H200, 2026-11-29; the clipping coefficient left out moved them by 2.9e-3
    there). Every copy is its weight's cast after every step."""
    ref, ref_norms, _ = _expert_steps_on_cuda(False)
    got, norms, fresh = _expert_steps_on_cuda(True, gradients)
    assert min(ref_norms) > 1e-3, "the steps were not clipped"
    assert fresh == [True] * 3 and norms == ref_norms, (norms, ref_norms)
    for a, b in zip(ref, got):
        if gradients:
            torch.testing.assert_close(b, a, rtol=2.0 ** -22, atol=1e-9)
        else:
            assert torch.equal(a, b), (a - b).abs().max().item()


def test_bf16_moments_round_stochastically_on_cuda():
    """``optimizer.moments_dtype = "bfloat16"`` on CUDA (the hash's bits in a Triton kernel):
    a value a quarter of the way between two bfloat16 neighbours rounds to one of
    them with the exact mean (within 5 standard deviations over 2^20 draws), and in the
    compiled update a second moment decaying by beta2 = 0.999 a step, which rounding to
    nearest freezes at 1, follows 0.999^step within 1% over 600 steps."""
    import math

    from torchtitan_omni.components.adam_update import (
        compiled_adam_update,
        round_stochastically,
        rounding_noise,
    )

    def rnd(x, seed):
        return round_stochastically(x, torch.bfloat16, rounding_noise(x, seed)[1])

    torch._dynamo.reset()
    n, ulp = 1 << 20, 2.0 ** -7
    x = torch.full((n,), 1.0 + 0.25 * ulp, device="cuda")
    got = torch.compile(rnd, fullgraph=True, dynamic=True)(x, torch.tensor(3, device="cuda"))
    assert set(got.float().unique().tolist()) <= {1.0, 1.0 + ulp}
    assert abs(got.double().mean().item() - x[0].item()) < 5 * ulp * math.sqrt(0.1875 / n)
    update = compiled_adam_update()
    param, grad = torch.zeros(16_384, device="cuda"), torch.zeros(16_384, device="cuda")
    m = torch.ones(16_384, device="cuda", dtype=torch.bfloat16)
    v = torch.ones_like(m)
    step = torch.zeros((), device="cuda")
    for _ in range(600):
        step += 1
        update(param, grad, m, v, step, None, lr=0.0, beta1=0.99, beta2=0.999, eps=1e-8,
               weight_decay=0.0, decoupled_weight_decay=True, maximize=False)
    assert v.double().mean().item() == pytest.approx(0.999 ** 600, rel=0.01)
    assert m.double().mean().item() == pytest.approx(0.99 ** 600, rel=0.01)


def test_bf16_expert_weights_on_cuda():
    """``optimizer.expert_weights_dtype = "bfloat16"`` on CUDA: 200 AdamW steps of a tenth of
    bfloat16's spacing each from weights of 1 move the bf16 weights on average as far as the
    float32 weights (within 2%; rounding to nearest would not move them); experts converted
    in place run grouped GEMM forward and backward on their bf16 weights, get bf16
    gradients, and the compiled update takes every one of them; a conversion after
    something took the weights' tensors (a state dict) is refused."""
    from torchtitan_omni.components.expert_weights import store_expert_weights_in
    from torchtitan_omni.components.optimizer import LocalShardAdamW
    from torchtitan_omni.modules.moe import GroupedExperts

    torch._dynamo.reset()
    spacing, n, steps = 2.0 ** -8, 16_384, 200

    def descent(dtype):
        param = torch.nn.Parameter(torch.ones(n, device="cuda", dtype=dtype))
        opt = LocalShardAdamW([param], lr=0.1 * spacing, eps=1e-12, weight_decay=0.0,
                              fused=True)
        opt.compile_updates(min_numel=1)
        for _ in range(steps):
            param.grad = torch.full((n,), 1e-3, device="cuda", dtype=dtype)
            opt.step()
        return 1.0 - param.detach().double().mean().item()

    exact = descent(torch.float32)
    assert exact == pytest.approx(steps * 0.1 * spacing, rel=0.01)
    assert descent(torch.bfloat16) == pytest.approx(exact, rel=0.02)
    experts = GroupedExperts(256, 128, 4).cuda()
    torch.nn.init.normal_(experts.w1, std=0.02)
    torch.nn.init.normal_(experts.w2, std=0.02)
    torch.nn.init.normal_(experts.w3, std=0.02)
    experts.compute_dtype = torch.bfloat16
    opt = LocalShardAdamW(experts.parameters(), lr=1e-3, fused=True)
    opt.compile_updates()
    assert store_expert_weights_in([experts], None, torch.bfloat16) == 3 * 4 * 256 * 128
    counts = torch.tensor([64, 0, 128, 64], device="cuda")
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    experts(x, counts).float().square().sum().backward()
    assert all(p.grad.dtype == torch.bfloat16 for p in experts.parameters())
    before = [p.detach().clone() for p in experts.parameters()]
    opt.step()
    assert opt.compiled_numel == 3 * 4 * 256 * 128
    assert all(p.dtype == torch.bfloat16 and not torch.equal(p, b)
               for p, b in zip(experts.parameters(), before))
    # a tensor of the old weights held elsewhere (a state dict taken before) is refused
    held = GroupedExperts(256, 128, 4).cuda()
    held.compute_dtype = torch.bfloat16
    state = held.state_dict()
    with pytest.raises(RuntimeError, match="still hold the weights in their old dtype"):
        store_expert_weights_in([held], None, torch.bfloat16)
    assert state["w1"].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "float32"])
def test_local_copies_triton_kernels_match_torch_on_cuda(dtype):
    """The gather dispatch's row maps (``modules.local_copies``) on CUDA: the Triton kernels
    against torch's implementation at an EP4 rank's shape (a quarter of the buffer used, NaN
    in the rest, which the kernels never read), and the dispatcher's local work compiled with
    them (inductor launching their kernels itself: no call of the operators in its code)
    against torch's ops over the whole buffer, forward and backward."""
    from torch._inductor.utils import run_and_get_code

    from torchtitan_omni.distributed.expert_gather import GatherExpertParallelDispatcher
    from torchtitan_omni.modules import local_copies as lc
    from torchtitan_omni.modules.init import init_context
    from torchtitan_omni.modules.moe import GroupedExperts

    g = torch.Generator().manual_seed(0)
    tokens, k, dim = 2048, 8, 2048
    rows = tokens * k
    count = torch.tensor(rows // 4, device="cuda")
    src = torch.randn(tokens, dim, generator=g).to("cuda", dtype)
    index = torch.randint(0, tokens, (rows,), generator=g).cuda()
    scale = torch.rand(rows, generator=g).to("cuda", dtype)
    got = lc.rows_below(src, index, scale, count)[: rows // 4]
    torch.testing.assert_close(got, lc._rows_below_torch(src, index, scale, count)[: rows // 4])
    pos = torch.randperm(rows, generator=g).cuda()
    y = torch.randn(rows, dim, generator=g).to("cuda", dtype)
    y[rows // 4:] = float("nan")
    w = torch.rand(tokens, k, generator=g).to("cuda", dtype)
    torch.testing.assert_close(lc.slot_sums(y, pos, count, w, k),
                               lc._slot_sums_torch(y, pos, count, w, k))
    torch.testing.assert_close(lc.slot_dots(y, src, pos, count, k),
                               lc._slot_dots_torch(y, src, pos, count, k), rtol=1e-4, atol=1e-3)

    class Group:
        def size(self):
            return 4

        def rank(self):
            return 1

    torch._dynamo.reset()
    experts = GroupedExperts(256, 128, 8)
    with init_context(experts, seed=0):
        experts.init_weights(0.05)
    experts = experts.to("cuda", dtype)
    ids = torch.rand(4 * 512, 32, generator=g).topk(k, dim=-1).indices.cuda()
    x = torch.randn(4 * 512, 256, generator=g).to("cuda", dtype)
    weights = torch.rand(4 * 512, k, generator=g).to("cuda", dtype)
    upstream = torch.randn(4 * 512, 256, generator=g).to("cuda", dtype)
    results = []
    for kernels in (True, False):
        experts.zero_grad(set_to_none=True)
        xi, wi = x.clone().requires_grad_(), weights.clone().requires_grad_()
        work = torch.compile(GatherExpertParallelDispatcher(Group(), 32, 512,
                                                            kernels=kernels).run_local,
                             fullgraph=True)
        out, code = run_and_get_code(work, experts, xi, wi, ids)
        if kernels:  # inductor launches the row maps' kernels from its own code
            source = "\n".join(code)
            assert "_rows_below_kernel" in source and "_rowwise_kernel" in source
            assert not [op for op in ("rows_below", "slot_sums", "swiglu_rows",
                                      "gather_copies", "combine_copies")
                        if f"torch.ops.torchtitan_omni.{op}" in source]
        out.backward(upstream)
        results.append([out, xi.grad, wi.grad, experts.w1.grad, experts.w2.grad])
    tol = BF16_REL if dtype == torch.bfloat16 else 1e-5
    for a, b in zip(*results):
        assert torch.isfinite(a).all() and _rel(a, b) < tol


def saved_by_compiled_moe_block(docs: list[int], option: str = "full") -> tuple[int, list]:
    """One Qwen3-MoE block (bf16, on the GPU) checkpointed in full (``option`` "full") or by a
    per-op selective option ("op", "attention") and compiled with inductor, as the trainer lays
    it out: its input's elements and what its forward saves for the backward other than its
    parameters and buffers, as ``(elements, shape, dtype)``, largest first."""
    from tests.distributed.common import qwen3_moe_foundation
    from torchtitan_omni.distributed.activation_checkpoint import checkpoint_units
    from torchtitan_omni.distributed.compile import compile_units

    model = qwen3_moe_foundation(256, 1, experts=16, top_k=4, device="cuda",
                                 dtype=torch.bfloat16)
    block = model.layers["0"]
    checkpoint_units([block], *(("full",) if option == "full" else ("selective", option)))
    compile_units([block], "inductor")
    state = {t.data_ptr() for t in (*model.parameters(), *model.buffers())}  # rope tables too
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in state:
            saved.append((t.numel(), tuple(t.shape), t.dtype))
        return t

    s = sum(docs)
    x = torch.randn(1, s, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0).cuda()
    meta = AttentionMeta(cu.cuda(), max(docs), pos)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = block(x, meta)
    out.float().sum().backward()  # the saved tensors are what the backward can run from
    return x.numel(), sorted(saved, key=lambda item: -item[0])


def test_compiled_moe_block_under_full_ac_saves_only_its_input():
    """Full AC inside a compiled MoE block keeps what eager full AC keeps on the GPU's fast
    paths too (FlashAttention-2 varlen, the Triton row maps, grouped GEMM): its input and
    nothing as large, so activation memory does not grow with the layers' expert copies (the
    forty-third session found 1 GiB of sorted copies and the attention's outputs held per
    layer at 16K; ``tests/distributed/test_compile.py`` checks the CPU paths)."""
    block_input, saved = saved_by_compiled_moe_block([600, 424])
    larger = [item for item in saved if item[0] > block_input]
    assert saved and not larger, saved


def test_compiled_moe_block_under_attention_ac_saves_its_input_and_the_attention():
    """``selective_ac_option = "attention"`` inside a compiled MoE block keeps the attention's
    output (``[tokens, heads, head_dim]``) and its float32 softmax statistics besides the
    block's input, and nothing larger than the input: the expert copies are recomputed."""
    block_input, saved = saved_by_compiled_moe_block([600, 424], "attention")
    larger = [item for item in saved if item[0] > block_input]
    assert not larger, saved
    tokens = 1024
    assert any(len(shape) == 3 and shape[0] == tokens and dtype == torch.bfloat16
               for _, shape, dtype in saved), saved  # the output
    assert any(tokens in shape and dtype == torch.float32 for _, shape, dtype in saved), saved
