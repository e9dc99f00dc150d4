"""Expert dispatch layer by layer on 4 gloo ranks against one process (float32): EP4 and EP2
(a 2 x 2 mesh), exact (capacity factor 0) and capacity-padded, with a rank whose tokens all
choose one expert, a rank that sends nothing to half the experts and a rank without tokens.
Outputs and input, router and expert gradients within 1e-5; routed and dropped copies exactly
equal to the single-process layer applying the same rule to each rank's tokens; and the
capacity-padded EP4 layer compiled as one graph (fullgraph=True) against eager. The chunked,
overlapped exchange (``parallelism.expert_dispatch_chunks`` 2 and 4, capacity factors 1.25
and 2.0, eager and compiled, also with two experts no rank sends a token to) also against the
same EP layer in one chunk, eager: outputs, input, router and expert gradients within 1e-5, the same
copies dropped; and the order of its backward: each chunk's reverse exchanges launched before,
and waited after, the experts' backward they overlap (eager, through the dispatcher's trace
hook, also with the experts FSDP-sharded; compiled, by counting the exchanges in flight at
each chunk's expert matmuls in the backward graph). And the trainer's reduction of the routing
counts (loads over the EP group, drops over all ranks). And activation checkpointing of two
EP2 MoE blocks around their exchanges (``parallelism.expert_ac_keep_exchanges``; exact,
capacity-padded, in 2 chunks, with the experts FSDP-sharded as the trainer shards them, and
compiled in pieces with aot_eager): outputs and gradients equal those without AC, and the step
runs as many all-to-alls as without AC (the recompute exchanges nothing), counted by a
dispatch mode, where a whole-block checkpoint runs the forward's again; checkpointed whole,
the exact dispatcher's recompute replays the forward's split sizes (one host read per layer
and step, as without AC; also when it sends each token once per rank). And the exact
dispatcher sending each token once per rank (``parallelism.expert_dispatch = "tokens"``):
EP4 and EP2 against one process as above (also with experts nobody routes to, and under AC
around its exchanges with FSDP-sharded experts), its forward exchange carrying one row per
(token, rank holding one of its experts). And the exact dispatcher gathering the group's
tokens (``parallelism.expert_dispatch = "gather"``; ranks with 12, 10, 9 and no tokens padded
to 12; the experts' rows past their groups poisoned with NaN, forward and backward, as grouped
GEMM may leave them): EP4 and EP2 against one process as above, also with experts nobody
routes to, and at EP2 compiled as one graph (fullgraph=True)."""

from __future__ import annotations

import functools

import pytest

from tests.harness import recorded, run_distributed

E, K, D, H = 8, 2, 16, 12
#: tokens per rank the capacity is sized for: C = ceil(1.0 x 8 x 2 / 8) = 2 slots
TOKENS = 8
#: tokens of each rank's batch (rank 3 has none)
SIZES = (12, 10, 9, 0)
RTOL = 1e-5


def _layer():
    import torch

    from torchtitan_omni.modules.init import init_context
    from torchtitan_omni.modules.moe import MoE

    moe = MoE(D, H, E, K)
    with init_context(moe, seed=3):
        moe.init_weights(0.3, 0.3)
    with torch.no_grad():  # router logits = 4 x the first E features: routing set by the input
        moe.gate.weight.zero_()
        moe.gate.weight[:, :E] = 4 * torch.eye(E)
    return moe


def _inputs(rank: int, idle: bool = False):
    import torch

    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(SIZES[rank], D, generator=g)
    if rank == 0:
        x[:, 0] = 3.0  # every token's first choice is expert 0
    if rank == 1:
        x[:, 4:E] = -3.0  # experts 4-7 get nothing from this rank
    if idle:
        x[:, E - 2:E] = -6.0  # experts 6 and 7 get nothing from any rank
    return x.requires_grad_(), torch.randn(SIZES[rank], D, generator=g)


def _error(a, b) -> float:
    scale = max(float(b.abs().max()) if b.numel() else 0.0, 1e-6)
    return float((a - b).abs().max()) / scale if b.numel() else 0.0


def _tail_poisoned(experts):
    """``experts`` whose rows past the last group come out NaN and send NaN gradients back:
    what grouped GEMM may leave there on GPU (unspecified rows), so a dispatcher that lets them
    reach a result fails on CPU too."""
    import torch

    from torchtitan_omni.modules.moe import GroupedExperts

    class NanGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, tail):
            ctx.save_for_backward(tail)
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            (tail,) = ctx.saved_tensors
            return torch.where(tail, float("nan"), grad), None

    class TailPoisoned(GroupedExperts):
        def forward(self, x, counts, used_rows=None):
            tail = (torch.arange(x.shape[0], device=x.device) >= counts.sum()).unsqueeze(1)
            out = super().forward(NanGradient.apply(x, tail), counts, used_rows=used_rows)
            return torch.where(tail, float("nan"), out)

    experts.__class__ = TailPoisoned
    return experts


def _ep_layer(ref, mesh, factor: float, chunks: int, compiled: bool, rank: int,
              idle: bool = False, unit: str = "copies"):
    """A copy of ``ref`` under EP on ``mesh``, run forward and backward on ``rank``'s inputs."""
    import copy

    import torch

    from torchtitan_omni.distributed.expert_parallel import make_dispatcher, shard_experts

    moe = copy.deepcopy(ref)
    shard_experts(moe.experts, mesh)
    # the gather dispatch pads every rank's tokens to the most a rank brings (12 here), and
    # its experts get rows past their groups: poisoned, as grouped GEMM may leave them
    tokens = max(SIZES) if unit == "gather" else TOKENS
    moe.dispatcher = make_dispatcher(E, K, mesh.get_group(), factor, tokens, chunks, unit)
    if unit == "gather":
        _tail_poisoned(moe.experts)
    x, grad = _inputs(rank, idle)
    if compiled:
        # a fresh cache per case: a recompile for another capacity factor would make dynamo
        # treat the factor as a dynamic float (one factor per run in training)
        torch._dynamo.reset()
    forward = torch.compile(moe, backend="aot_eager", fullgraph=True) if compiled else moe
    out, stats = forward(x)
    (out * grad).sum().backward()
    return moe, out, stats, x


def against_one_process(ref, moe, out, x, group, rank: int, ep: int, idle: bool = False):
    """Run ``ref`` (the layer in one process) on every rank of ``moe``'s EP group in turn and
    pair what ``moe`` computed on ``rank`` with it: ``({name: (ep value, reference)}`` for the
    output and the input, router and expert gradients, the reference's routing statistics
    and input)."""
    import torch.distributed as dist

    members = dist.get_process_group_ranks(group)
    total, mine = 0.0, None
    for source in members:
        xs, gs = _inputs(source, idle)
        o, st = ref(xs)
        total = total + (o * gs).sum()
        if source == rank:
            mine = (o, st, xs)
    total.backward()
    ref_out, ref_stats, ref_x = mine
    router = moe.gate.weight.grad.clone()
    dist.all_reduce(router, group=group)  # the router is replicated: its gradients add up
    local = E // ep
    rows = slice(members.index(rank) * local, (members.index(rank) + 1) * local)
    pairs = {"out": (out, ref_out), "x": (x.grad, ref_x.grad),
             "router": (router, ref.gate.weight.grad)}
    for name in ("w1", "w2", "w3"):
        pairs[name] = (getattr(moe.experts, name).grad.to_local(),
                       getattr(ref.experts, name).grad[rows])
    return pairs, ref_stats, ref_x


def _case(rank: int, world: int, ep: int, factor: float, compiled: bool = False,
          chunks: int = 1, idle: bool = False, unit: str = "copies") -> dict:
    from unittest import mock

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_omni.distributed import expert_tokens
    from torchtitan_omni.modules.moe_capacity import CapacityDispatcher

    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("dp", "ep"))["ep"]
    group = mesh.get_group()
    ref = _layer()
    sent = []  # rows the token dispatcher hands to each of its exchanges (forward)

    def counting(x, *args):
        sent.append(x.shape[0])
        return real(x, *args)

    real = expert_tokens.all_to_all_v
    with mock.patch.object(expert_tokens, "all_to_all_v", counting):
        moe, out, stats, x = _ep_layer(ref, mesh, factor, chunks, compiled, rank, idle, unit)

    if factor:
        ref.dispatcher = CapacityDispatcher(E, K, factor, TOKENS)
    pairs, ref_stats, ref_x = against_one_process(ref, moe, out, x, group, rank, ep, idle)
    errors = {name: _error(a, b) for name, (a, b) in pairs.items()}
    router = pairs["router"][0]
    result = {"dispatcher": type(moe.dispatcher).__name__,
              "routed": stats.routed.tolist(), "ref_routed": ref_stats.routed.tolist(),
              "dropped": stats.dropped.tolist(), "ref_dropped": ref_stats.dropped.tolist(),
              "sent": sent[:1], "ranks_per_token": _ranks_per_token(ref_x, E // ep)}
    if chunks > 1:  # and against the same EP layer exchanging in one chunk, eager: a compiled
        # chunked layer is held to the eager one (the compiled one-chunk layer has its own case,
        # ep4_capacity_compiled), and one compile of the layer less per case on 4 ranks
        one, out1, stats1, x1 = _ep_layer(_layer(), mesh, factor, 1, False, rank, idle)
        router1 = one.gate.weight.grad.clone()
        dist.all_reduce(router1, group=group)
        errors.update({"out_vs_1": _error(out, out1), "x_vs_1": _error(x.grad, x1.grad),
                       "router_vs_1": _error(router, router1)})
        for name in ("w1", "w2", "w3"):
            errors[f"{name}_vs_1"] = _error(getattr(moe.experts, name).grad.to_local(),
                                            getattr(one.experts, name).grad.to_local())
        result["dropped_1"] = stats1.dropped.tolist()
    return dict(result, errors=errors)


def _ranks_per_token(x, local: int) -> list[int]:
    """For each of a rank's tokens, how many EP ranks hold one of its K experts."""
    import torch

    chosen = torch.topk(_layer().gate(x.detach()), K, dim=-1).indices
    return [len(set((row // local).tolist())) for row in chosen]


#: name: (EP degree, capacity factor, compiled, dispatch chunks, idle experts). Capacity C =
#: ceil(factor x 8 x 2 / 8): 1.0 -> 2 slots, 1.25 -> 3 (chunks 2: widths 2 + 1; chunks 4: three
#: chunks of 1), 2.0 -> 4 (chunks 2: 2 + 2; chunks 4: 1 each). Idle: experts 6 and 7 get no
#: token from any rank (under EP4 one rank's experts compute only empty slots).
CASES = {
    "ep4_exact": (4, 0.0, False, 1, False),
    "ep4_capacity": (4, 1.0, False, 1, False),
    "ep2_exact": (2, 0.0, False, 1, False),
    "ep2_capacity": (2, 1.0, False, 1, False),
    "ep4_capacity_compiled": (4, 1.0, True, 1, False),
    "ep4_cap1.25_chunks2": (4, 1.25, False, 2, False),
    "ep4_cap1.25_chunks4": (4, 1.25, False, 4, False),
    "ep2_cap1.25_chunks2": (2, 1.25, False, 2, False),
    "ep2_cap1.25_chunks4": (2, 1.25, False, 4, False),
    "ep4_cap2.0_chunks2": (4, 2.0, False, 2, False),
    "ep4_cap2.0_chunks4": (4, 2.0, False, 4, False),
    "ep2_cap2.0_chunks2": (2, 2.0, False, 2, False),
    "ep2_cap2.0_chunks4": (2, 2.0, False, 4, False),
    "ep4_cap2.0_chunks4_idle": (4, 2.0, False, 4, True),
    "ep2_cap1.25_chunks2_idle": (2, 1.25, False, 2, True),
    "ep4_cap1.25_chunks2_compiled": (4, 1.25, True, 2, False),
    "ep2_cap2.0_chunks4_compiled": (2, 2.0, True, 4, False),
}
#: the exact dispatcher sending each token once per rank (``expert_dispatch = "tokens"``)
TOKEN_CASES = {
    "ep4_exact_tokens": (4, 0.0, False, 1, False),
    "ep2_exact_tokens": (2, 0.0, False, 1, False),
    "ep4_exact_tokens_idle": (4, 0.0, False, 1, True),
}
#: the exact dispatcher gathering the group's tokens (``expert_dispatch = "gather"``), also
#: compiled as one graph (fullgraph: nothing is read on the host)
GATHER_CASES = {
    "ep4_exact_gather": (4, 0.0, False, 1, False),
    "ep2_exact_gather": (2, 0.0, False, 1, False),
    "ep4_exact_gather_idle": (4, 0.0, False, 1, True),
    "ep2_exact_gather_compiled": (2, 0.0, True, 1, False),
}


def _counts_case(rank: int, world: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_omni.distributed.utils import reduce_moe_counts

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    counts = torch.arange(2 * 3 * 4).view(2, 3, 4) * (rank + 1)
    loads, totals = reduce_moe_counts(counts, mesh["ep"], mesh)
    return {"loads": loads.tolist(), "totals": totals.tolist()}


#: chunks of the backward-order case (capacity 4 slots: 4 chunks of one slot)
ORDER_CHUNKS = 4


def _backward_order_case(rank: int, world: int, fsdp: bool) -> list:
    """The events of one eager backward in ``ORDER_CHUNKS`` chunks, in order: the
    dispatcher's launches and waits of each chunk's gradient exchanges (its test hook), and
    each chunk's experts backward, starting when the gradient of the experts' output arrives
    and ending when that of their input is complete. EP4, or (``fsdp``) EP2 with the experts
    FSDP-sharded over the other 2 ranks (their hooks run per chunk, resharding after
    forward)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torchtitan_omni.distributed.expert_parallel import make_dispatcher, shard_experts

    shape = (2, world // 2) if fsdp else (1, world)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("efsdp", "ep"))
    moe = copy.deepcopy(_layer())
    shard_experts(moe.experts, mesh["ep"])
    if fsdp:
        fully_shard(moe.experts, mesh=mesh["efsdp"], reshard_after_forward=True)
    moe.dispatcher = make_dispatcher(E, K, mesh["ep"].get_group(), 2.0, TOKENS, ORDER_CHUNKS)
    events: list = []
    moe.dispatcher.trace = lambda *event: events.append(event)

    def record(event, chunk):
        return lambda grad: events.append((event, "experts", chunk))

    def hook(module, args, out):
        chunk = sum(1 for e in events if e[0] == "forward")
        events.append(("forward", "experts", chunk))
        out.register_hook(record("start", chunk))
        args[0].register_hook(record("end", chunk))

    moe.experts.register_forward_hook(hook)
    x, grad = _inputs(rank)
    out, _ = moe(x)
    (out * grad).sum().backward()
    return events


def _compiled_backward_case(rank: int, world: int) -> list[str]:
    """The same layer compiled (fullgraph, AOT autograd without inductor): its backward
    graph's collectives and batched matmuls in graph order, "L" a launched all-to-all, "W" a
    wait, "M" a bmm (the experts compute with batched matmuls on padded groups)."""
    import copy

    import torch
    from torch._dynamo.backends.common import aot_autograd
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_omni.distributed.expert_parallel import make_dispatcher, shard_experts

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    moe = copy.deepcopy(_layer())
    shard_experts(moe.experts, mesh)
    moe.dispatcher = make_dispatcher(E, K, mesh.get_group(), 2.0, TOKENS, ORDER_CHUNKS)
    kinds: list[str] = []
    names = {"all_to_all_single": "L", "wait_tensor": "W", "bmm": "M"}

    def backward_compiler(gm, _):
        for node in gm.graph.nodes:
            name = getattr(node.target, "__name__", "").split(".")[0]
            if name in names:
                kinds.append(names[name])
        return gm

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=backward_compiler)
    x, grad = _inputs(rank)
    out, _ = torch.compile(moe, backend=backend, fullgraph=True)(x)
    (out * grad).sum().backward()
    return kinds


class _Block:
    """Factory of a residual MoE block (``x + moe(x)``); module-level for the spawned ranks."""

    @staticmethod
    def make(moe):
        import torch.nn as nn

        class Block(nn.Module):
            compile_fullgraph = False  # experts sharded over ep: compiled in pieces

            def __init__(self) -> None:
                super().__init__()
                self.norm = nn.LayerNorm(D)  # a piece checkpointed on its own
                self.moe = moe

            def forward(self, x):
                return x + self.moe(self.norm(x))[0]

        return Block()


#: layers of the activation-checkpointing cases
AC_LAYERS = 2


def _ep_blocks(mesh, factor: float, chunks: int, fsdp: bool, unit: str = "copies"):
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    from torchtitan_omni.distributed.expert_parallel import make_dispatcher, shard_experts

    blocks = []
    for _ in range(AC_LAYERS):
        moe = _layer()
        shard_experts(moe.experts, mesh["ep"])
        if fsdp:  # the experts' own FSDP unit inside the block, as the trainer has it
            fully_shard(moe.experts, mesh=mesh["efsdp"], reshard_after_forward=True)
        moe.dispatcher = make_dispatcher(E, K, mesh["ep"].get_group(), factor, TOKENS, chunks,
                                         unit)
        blocks.append(_Block.make(moe))
    return nn.ModuleList(blocks)


def _counting_mode():
    """A dispatch mode counting all-to-alls (functional or in place)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        @classmethod
        def ignore_compile_internals(cls):
            return True  # let dynamo compile under it (the compiled case)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if "all_to_all" in name or "alltoall" in name:
                self.calls += 1
            return func(*args, **(kwargs or {}))

    return Count()


def _ac_step(blocks, rank: int, roll: int = 0):
    """One forward and backward of ``blocks`` on ``rank``'s inputs (features rolled by
    ``roll``: another routing): (output, input grad, all-to-alls)."""
    x, grad = _inputs(rank)
    if roll:
        x = x.detach().roll(roll, dims=1).requires_grad_()
    mode = _counting_mode()
    with mode:
        h = x
        for block in blocks:
            h = block(h)
        (h * grad).sum().backward()
    return h.detach(), x.grad, mode.calls


def _ac_case(rank: int, world: int, unit: str, factor: float, chunks: int, fsdp: bool,
             compiled: bool) -> dict:
    """EP2 blocks checkpointed around their exchanges (checkpoint_units, as parallelize
    applies it) against the same blocks without AC and checkpointed whole."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_omni.compat import compiled_graph_count
    from torchtitan_omni.distributed.activation_checkpoint import checkpoint_units
    from torchtitan_omni.distributed.compile import compile_units

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("efsdp", "ep"))
    # alike by construction: the layers' seeded init, LayerNorm's ones and zeros
    plain, ac, whole = (_ep_blocks(mesh, factor, chunks, fsdp, unit) for _ in range(3))
    if compiled:
        torch._dynamo.reset()
        compile_units(list(ac), "aot_eager", graph_breaks=True)
    assert checkpoint_units(list(ac), "full", keep_exchanges=True) == AC_LAYERS
    assert checkpoint_units(list(whole), "full") == AC_LAYERS
    out, x_grad, calls = _ac_step(plain, rank)
    if compiled:  # compile first, count the second step
        _ac_step(ac, rank)
        ac.zero_grad()
    ac_out, ac_x_grad, ac_calls = _ac_step(ac, rank)
    graphs = compiled_graph_count() if compiled else 0
    _, _, whole_calls = _ac_step(whole, rank)
    errors = {"out": _error(ac_out, out), "x": _error(ac_x_grad, x_grad)}
    full = (lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g)
    for (name, p), q in zip(plain.named_parameters(), ac.parameters()):
        errors[name] = _error(full(q.grad), full(p.grad))
    return {"errors": errors, "calls": calls, "ac_calls": ac_calls,
            "whole_calls": whole_calls, "graphs": graphs}


def _replay_case(rank: int, world: int, unit: str) -> dict:
    """EP2 blocks with the exact dispatcher (``unit``: "copies" or "tokens") checkpointed whole
    (full AC, as parallelize applies it) against the same blocks without AC: errors,
    all-to-alls, and how often the dispatcher exchanged counts and read its split sizes on the
    host (both dispatchers do the two together, once per call: the exchanges are counted)."""
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_omni.distributed import expert_parallel, expert_tokens
    from torchtitan_omni.distributed.activation_checkpoint import checkpoint_units

    reads = []
    originals = {m: m.exchange_counts for m in (expert_parallel, expert_tokens)}
    for module, exchange in originals.items():
        def counted(*args, _exchange=exchange, **kwargs):
            reads.append(1)
            return _exchange(*args, **kwargs)
        module.exchange_counts = counted
    try:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("efsdp", "ep"))
        plain, whole = (_ep_blocks(mesh, 0.0, 1, True, unit) for _ in range(2))
        assert checkpoint_units(list(whole), "full") == AC_LAYERS
        out, x_grad, calls = _ac_step(plain, rank)
        plain_reads = len(reads)
        whole_out, whole_x_grad, whole_calls = _ac_step(whole, rank)
        errors = {"out": _error(whole_out, out), "x": _error(whole_x_grad, x_grad)}
        full = (lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g)
        for (name, p), q in zip(plain.named_parameters(), whole.parameters()):
            errors[name] = _error(full(q.grad), full(p.grad))
        result = {"errors": errors, "calls": calls, "whole_calls": whole_calls,
                  "plain_reads": plain_reads, "whole_reads": len(reads) - plain_reads}
        result.update(_replay_compiled(mesh, rank, reads, unit))
        if unit == "tokens":
            recompiling = _replay_compiled(mesh, rank, reads, unit, dynamic_pieces=False)
            result["recompiling"] = {"errors": recompiling["compiled_errors"],
                                     "graphs": recompiling["graphs"]}
    finally:
        for module, exchange in originals.items():
            module.exchange_counts = exchange
    return result


def _replay_compiled(mesh, rank: int, reads: list, unit: str,
                     dynamic_pieces: bool = True) -> dict:
    """The same blocks compiled in pieces (aot_eager) inside their whole-block checkpoints,
    over three steps whose routing differs (the router's features rolled): errors against
    the eager blocks without AC, host reads in the last step, graphs compiled in the last.
    ``dynamic_pieces`` False: compiled as dynamo would by default (sizes specialized until
    they change, then recompiled), the path that once failed inside dynamo for the token
    dispatch's split sizes."""
    from unittest import mock

    import torch

    from torchtitan_omni.compat import compiled_graph_count
    from torchtitan_omni.distributed.activation_checkpoint import checkpoint_units
    from torchtitan_omni.distributed.compile import compile_units

    torch._dynamo.reset()
    plain, whole = (_ep_blocks(mesh, 0.0, 1, True, unit) for _ in range(2))
    compile_fn = torch.compile
    if dynamic_pieces:
        compile_units(list(whole), "aot_eager", graph_breaks=True)
    else:
        with mock.patch.object(torch, "compile",
                               lambda fn, **kw: compile_fn(fn, **dict(kw, dynamic=None))):
            compile_units(list(whole), "aot_eager", graph_breaks=True)
    checkpoint_units(list(whole), "full")
    errors, graphs = {}, []
    for step in range(3):
        if step == 2:
            last_reads = len(reads)
        out, x_grad, _ = _ac_step(plain, rank, roll=step)
        whole_out, whole_x_grad, _ = _ac_step(whole, rank, roll=step)
        errors[f"step {step} out"] = _error(whole_out, out)
        errors[f"step {step} x"] = _error(whole_x_grad, x_grad)
        graphs.append(compiled_graph_count())
    return {"compiled_errors": errors, "compiled_last_reads": len(reads) - last_reads,
            "graphs": graphs}


#: name: (expert dispatch unit, capacity factor, dispatch chunks, experts FSDP-sharded,
#: compiled, all-to-alls per layer without AC) of the activation-checkpointing cases (EP2):
#: exact 5 (counts, dispatch, combine; 2 backward; either unit), capacity 4, capacity in 2
#: chunks (C = 3: widths 2 + 1) 8
AC_CASES = {
    "ac_exact_fsdp": ("copies", 0.0, 1, True, False, 5),
    "ac_exact_tokens_fsdp": ("tokens", 0.0, 1, True, False, 5),
    "ac_capacity": ("copies", 1.0, 1, False, False, 4),
    "ac_cap1.25_chunks2_fsdp": ("copies", 1.25, 2, True, False, 8),
    "ac_capacity_compiled": ("copies", 1.0, 1, False, True, 4),
}


def _all_cases(rank, world):
    results = {"counts": _counts_case(rank, world)}
    for unit in ("copies", "tokens"):
        results[f"replay_{unit}"] = recorded(_replay_case, rank, world, unit)
    for name, (unit, factor, chunks, fsdp, compiled, _) in AC_CASES.items():
        results[name] = recorded(_ac_case, rank, world, unit, factor, chunks, fsdp, compiled)
    for name, case in (("order", functools.partial(_backward_order_case, fsdp=False)),
                       ("order_fsdp", functools.partial(_backward_order_case, fsdp=True)),
                       ("compiled_order", _compiled_backward_case)):
        results[name] = recorded(case, rank, world)
    for name, (ep, factor, compiled, chunks, idle) in CASES.items():
        results[name] = recorded(_case, rank, world, ep, factor, compiled, chunks, idle)
    for name, (ep, factor, compiled, chunks, idle) in TOKEN_CASES.items():
        results[name] = recorded(_case, rank, world, ep, factor, compiled, chunks, idle,
                                 "tokens")
    for name, (ep, factor, compiled, chunks, idle) in GATHER_CASES.items():
        results[name] = recorded(_case, rank, world, ep, factor, compiled, chunks, idle,
                                 "gather")
    return results


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_cases, 4, timeout=600)


@pytest.mark.parametrize("name", sorted(CASES) + sorted(TOKEN_CASES) + sorted(GATHER_CASES))
def test_dispatch_matches_one_process(results, name):
    from torchtitan_omni.modules.moe_capacity import capacity

    ep, factor, _, chunks, idle = CASES.get(name) or TOKEN_CASES.get(name) or GATHER_CASES[name]
    for rank, res in enumerate(results):
        out = res[name]
        assert "error" not in out, f"rank {rank}: {out.get('error')}"
        bad = {k: v for k, v in out["errors"].items() if not v <= RTOL}  # NaN is bad too
        assert not bad, f"rank {rank}: {bad}"
        assert out["routed"] == out["ref_routed"] and out["dropped"] == out["ref_dropped"], out
        if chunks > 1:
            assert out["dropped"] == out["dropped_1"], out
        expected = ("TokenExpertParallelDispatcher" if name in TOKEN_CASES
                    else "GatherExpertParallelDispatcher" if name in GATHER_CASES
                    else "ChunkedCapacityExpertParallelDispatcher" if chunks > 1
                    else "CapacityExpertParallelDispatcher" if factor
                    else "ExpertParallelDispatcher")
        assert out["dispatcher"] == expected
    routed = [res[name]["routed"] for res in results]
    assert routed[0][0] == SIZES[0], "rank 0's tokens must all choose expert 0"
    assert sum(routed[1][4:]) == 0, "rank 1 must send nothing to experts 4-7"
    if idle:
        assert all(sum(r[E - 2:]) == 0 for r in routed), "experts 6-7 must get no token"
    dropped = [sum(res[name]["dropped"]) for res in results]
    if factor:
        # C slots per (rank, expert): rank 0 drops all but C of its 12 copies for expert 0
        cap = capacity(TOKENS, K, E, factor)
        assert results[0][name]["dropped"][0] == SIZES[0] - cap, dropped
    else:
        assert dropped == [0, 0, 0, 0]


@pytest.mark.parametrize("name", sorted(TOKEN_CASES))
def test_token_dispatch_sends_each_token_once_per_rank(results, name):
    """The token dispatcher's forward exchange carries one row per (token, rank holding one of
    its experts): fewer than the K copies per token whenever two choices share a rank (which
    this routing makes happen on every rank that has tokens)."""
    for rank, res in enumerate(results):
        out = res[name]
        assert "error" not in out, f"rank {rank}: {out.get('error')}"
        per_token = out["ranks_per_token"]
        assert out["sent"] == [sum(per_token)], (rank, out["sent"], per_token)
        if SIZES[rank]:
            assert sum(per_token) < K * SIZES[rank], (rank, per_token)


@pytest.mark.parametrize("case", ["order", "order_fsdp"])
def test_backward_overlaps_each_chunks_exchanges_with_the_experts(results, case):
    """In backward, chunk c-1's reverse combine all-to-all is launched before chunk c's
    experts backward starts, and chunk c's reverse dispatch travels during chunk c-1's; also
    with FSDP's hooks on the experts."""
    for rank, res in enumerate(results):
        events = res[case]
        assert "error" not in events, f"rank {rank}: {events}"
        at = {event: i for i, event in enumerate(events)}
        assert len(at) == len(events), events
        for c in range(ORDER_CHUNKS):
            start, end = at[("start", "experts", c)], at[("end", "experts", c)]
            assert at[("launch", "combine", c)] < at[("wait", "combine", c)] < start < end, events
            assert end < at[("launch", "dispatch", c)] < at[("wait", "dispatch", c)], events
            if c:  # the next chunk in backward order: c-1
                assert at[("launch", "combine", c - 1)] < start, (rank, c, events)
                assert at[("launch", "dispatch", c)] < at[("start", "experts", c - 1)], events
                assert at[("wait", "dispatch", c)] > at[("end", "experts", c - 1)], events


def test_compiled_backward_keeps_exchanges_in_flight_during_the_experts(results):
    """The compiled backward graph launches every chunk's reverse combine before its first
    wait, and some exchange is in flight during every chunk's experts matmuls."""
    for rank, res in enumerate(results):
        kinds = res["compiled_order"]
        assert "error" not in kinds, f"rank {rank}: {kinds}"
        collectives = [k for k in kinds if k != "M"]
        assert collectives[:ORDER_CHUNKS + 1] == ["L"] * ORDER_CHUNKS + ["W"], kinds
        in_flight, runs = 0, []
        for i, kind in enumerate(kinds):
            in_flight += {"L": 1, "W": -1, "M": 0}[kind]
            waited = "W" in kinds[:i]  # matmuls before the first wait: the routing combine's
            if kind == "M" and waited and kinds[i - 1] != "M":
                runs.append(in_flight)
        assert len(runs) == ORDER_CHUNKS and min(runs) >= 1, (runs, kinds)
        assert runs[0] == ORDER_CHUNKS - 1, (runs, kinds)


def test_routing_counts_reduction(results):
    import torch

    base = torch.arange(2 * 3 * 4).view(2, 3, 4)
    for rank, res in enumerate(results):
        group = (1 + 2) if rank < 2 else (3 + 4)  # sum of (rank + 1) over the EP group
        assert res["counts"]["loads"] == (base[0] * group).tolist()
        assert res["counts"]["totals"] == (base.sum(-1) * (1 + 2 + 3 + 4)).tolist()


@pytest.mark.parametrize("name", sorted(AC_CASES))
def test_ac_around_the_expert_exchanges(results, name):
    """Checkpointed around their exchanges, MoE blocks under EP2 give the outputs and
    gradients of the blocks without AC, and the recompute communicates nothing: as many
    all-to-alls per step as without AC (4 per layer for the capacity dispatcher, not 6), where
    a whole-block checkpoint runs the forward's again."""
    *_, compiled, per_layer = AC_CASES[name]
    for rank, res in enumerate(results):
        out = res[name]
        assert "error" not in out, f"rank {rank}: {out.get('error')}"
        bad = {k: v for k, v in out["errors"].items() if not v <= RTOL}  # NaN is bad too
        assert not bad, f"rank {rank}: {bad}"
        assert out["calls"] == per_layer * AC_LAYERS, out
        assert out["ac_calls"] == out["calls"], out
        assert out["whole_calls"] > out["calls"], out  # the whole block's recompute exchanges
        assert (out["graphs"] > 0) == compiled, out


@pytest.mark.parametrize("unit", ["copies", "tokens"])
def test_whole_block_recompute_replays_the_split_sizes(results, unit):
    """Exact dispatch under full AC of whole MoE blocks (EP2, FSDP-sharded experts): the
    recompute replays the forward's split sizes, so the host reads them once per layer and
    step, as without AC, and the recompute skips the counts exchange (it still exchanges the
    rows: dispatch and combine, 2 all-to-alls per layer more than without AC, not 3). Outputs
    and gradients equal those without AC."""
    for rank, res in enumerate(results):
        out = res[f"replay_{unit}"]
        assert "error" not in out, f"rank {rank}: {out.get('error')}"
        bad = {k: v for k, v in out["errors"].items() if not v <= RTOL}  # NaN is bad too
        assert not bad, f"rank {rank}: {bad}"
        assert out["plain_reads"] == out["whole_reads"] == AC_LAYERS, out
        assert out["whole_calls"] == out["calls"] + 2 * AC_LAYERS, out
        # compiled in pieces inside the checkpoints, routing changing from step to step: the
        # same, one read per layer and block kind (plain, whole) in the last step, and no
        # recompile after the first step (the pieces compile with dynamic sizes from the start)
        bad = {k: v for k, v in out["compiled_errors"].items() if not v <= RTOL}  # NaN is bad too
        assert not bad, f"rank {rank}: {bad}"
        assert out["compiled_last_reads"] == 2 * AC_LAYERS, out
        assert out["graphs"][0] > 0 and out["graphs"][2] == out["graphs"][0], out
        if unit == "tokens":  # and compiled with sizes specialized until they change
            again = out["recompiling"]
            bad = {k: v for k, v in again["errors"].items() if not v <= RTOL}  # NaN is bad too
            assert not bad, f"rank {rank}: {bad}"
            assert again["graphs"][2] > again["graphs"][0], again  # it did recompile
