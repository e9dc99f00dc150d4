"""The exact expert-parallel dispatcher with split sizes on the device
(``parallelism.expert_exchange = "nvshmem"``,
``torchtitan_omni.distributed.expert_device_splits``), on CPU.

NVSHMEM needs CUDA; here the dispatcher runs with a row exchange of the same contract over
gloo (split sizes read on the host, the rows past the received ones filled with NaN, as
unspecified as they can be). Its own parts are what is tested: the device-computed maps from
the received layout to the experts' one (against the NCCL dispatcher's host-built order, with
empty blocks), and the layer on 4 gloo ranks, EP4 and EP2 (2 x 2 mesh), against the same
layer in one process (float32, the cases of ``test_moe_dispatch``: a rank whose tokens all
choose one expert, a rank sending nothing to half the experts, a rank without tokens; EP4
also under ``torch.compile``, aot_eager):
outputs, input, router and expert gradients within 1e-5, every one finite. And that its
dispatch, combine and their backward read nothing on the host (no scalar read, ``tolist``,
``nonzero``, boolean-mask index or ``repeat_interleave`` without its output size), where the
NCCL dispatcher's dispatch does (the detector's own check). On GPU,
``scripts/bench_expert_exchange.py`` checks NVSHMEM's exchange against the NCCL dispatcher.
"""

from __future__ import annotations

import pytest

from tests.distributed.test_moe_dispatch import (
    E, K, RTOL, SIZES, _error, _inputs, _layer, against_one_process,
)
from tests.harness import recorded, run_distributed

ROWS_PER_RANK = max(SIZES) * K


class GlooRowExchange:
    """``RowExchange`` over a gloo group: split sizes read on the host (a test stand-in for
    NVSHMEM's device-split all-to-all-v), unspecified rows filled with NaN."""

    def __init__(self, group, capacity: int) -> None:
        self.group, self.capacity = group, capacity

    def exchange(self, x, in_splits, out_rows, send_order=None, recv_order=None):
        import torch
        import torch.distributed as dist

        from torchtitan_omni.distributed.expert_device_splits import read_rows, write_rows

        send_buf = x.new_full((self.capacity, x.shape[1]), float("nan"))
        recv_buf = x.new_full((self.capacity, x.shape[1]), float("nan"))
        write_rows(send_buf, x, send_order)
        out_splits = torch.empty_like(in_splits)
        dist.all_to_all_single(out_splits, in_splits.contiguous(), group=self.group)
        send, recv = in_splits.tolist(), out_splits.tolist()
        got = x.new_empty(sum(recv), x.shape[1])
        dist.all_to_all_single(got, send_buf[: sum(send)].contiguous(), recv, send,
                               group=self.group)
        recv_buf[: got.shape[0]] = got
        return read_rows(recv_buf, out_rows, recv_order), out_splits


def test_expert_major_maps_match_the_host_order():
    import torch

    from torchtitan_omni.distributed.expert_device_splits import expert_major_maps
    from torchtitan_omni.distributed.expert_parallel import _expert_major_order

    g = torch.Generator().manual_seed(0)
    for ranks, local in ((2, 4), (4, 2), (3, 5)):
        recv = torch.randint(0, 4, (ranks, local), generator=g)
        recv[0, 1] = 0
        recv[-1] = 0  # a rank that sends nothing
        used = int(recv.sum())
        capacity = used + 7
        perm, inverse = expert_major_maps(recv, capacity)
        assert torch.equal(perm[:used], _expert_major_order(recv, used))
        assert torch.equal(perm[used:], torch.arange(used, capacity))
        assert torch.equal(perm[inverse], torch.arange(capacity))
    perm, inverse = expert_major_maps(torch.zeros(2, 3, dtype=torch.long), 4)
    assert torch.equal(perm, torch.arange(4)) and torch.equal(inverse, torch.arange(4))


class LoopbackRowExchange:
    """``RowExchange`` of a one-rank group with no host read of its own: what is sent
    arrives."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    def exchange(self, x, in_splits, out_rows, send_order=None, recv_order=None):
        from torchtitan_omni.distributed.expert_device_splits import read_rows, write_rows

        buffer = x.new_full((self.capacity, x.shape[1]), float("nan"))
        write_rows(buffer, x, send_order)
        return read_rows(buffer, out_rows, recv_order), in_splits.clone()


#: ops that read device values on the host, or whose output size depends on them
HOST_READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique",
              "aten._unique")


def _host_reads(rank: int, world: int) -> dict:
    """Host reads in a dispatch, combine and their backward on a one-rank group, for the
    device-split dispatcher and (the detector's check) the NCCL one."""
    from unittest import mock

    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from torchtitan_omni.distributed.expert_device_splits import (
        DeviceSplitExpertParallelDispatcher,
    )
    from torchtitan_omni.distributed.expert_parallel import ExpertParallelDispatcher

    class Reads(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = str(func)
            bool_index = name.startswith("aten.index.Tensor") and any(
                i is not None and i.dtype == torch.bool for i in args[1])
            unsized = name.startswith("aten.repeat_interleave") and "output_size" not in kwargs
            if name.startswith(HOST_READS) or bool_index or unsized:
                self.seen.append(name)
            return func(*args, **kwargs)

    group = dist.group.WORLD
    rows = 24
    counts = torch.tensor([5, 0, 7, 3, 0, 0, 4, 5])
    x = torch.randn(int(counts.sum()), 16, requires_grad=True)
    seen = {}
    for name, dispatcher in (
        ("device", DeviceSplitExpertParallelDispatcher(group, 8, rows, LoopbackRowExchange(rows))),
        ("nccl", ExpertParallelDispatcher(group, 8)),
    ):
        mode, listed = Reads(), []
        real_tolist = torch.Tensor.tolist

        def tolist(t, _listed=listed, _real=real_tolist):
            _listed.append("tolist")
            return _real(t)

        with mode, mock.patch.object(torch.Tensor, "tolist", tolist):
            grouped, local, state = dispatcher.dispatch(x, counts)
            out = dispatcher.combine(grouped * 2, state)
            out.sum().backward()
        seen[name] = {"reads": mode.seen + listed, "round_trip": bool(torch.equal(out, 2 * x)),
                      "grad": bool(torch.equal(x.grad, torch.full_like(x, 2.0)))}
        x.grad = None
    return seen


def test_device_split_dispatch_reads_nothing_on_the_host():
    (seen,) = run_distributed(_host_reads, 1)
    assert seen["device"] == {"reads": [], "round_trip": True, "grad": True}, seen["device"]
    assert seen["nccl"]["reads"], "the detector must see the NCCL dispatcher's split-size read"
    assert seen["nccl"]["round_trip"] and seen["nccl"]["grad"]


def _case(rank: int, world: int, ep: int, compiled: bool = False) -> dict:
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_omni.distributed.expert_device_splits import (
        DeviceSplitExpertParallelDispatcher,
    )
    from torchtitan_omni.distributed.expert_parallel import shard_experts

    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("dp", "ep"))["ep"]
    group = mesh.get_group()
    ref = _layer()
    moe = copy.deepcopy(ref)
    shard_experts(moe.experts, mesh)
    moe.dispatcher = DeviceSplitExpertParallelDispatcher(
        group, E, ROWS_PER_RANK, exchange=GlooRowExchange(group, ep * ROWS_PER_RANK))
    x, grad = _inputs(rank)
    if compiled:  # graph breaks around the exchange (it is not traced), none elsewhere needed
        torch._dynamo.reset()
    out, stats = (torch.compile(moe, backend="aot_eager") if compiled else moe)(x)
    (out * grad).sum().backward()

    grads, ref_stats, _ = against_one_process(ref, moe, out, x, group, rank, ep)
    return {"errors": {k: _error(a, b) for k, (a, b) in grads.items()},
            "finite": {k: bool(torch.isfinite(a).all()) for k, (a, _) in grads.items()},
            "routed": stats.routed.tolist(), "ref_routed": ref_stats.routed.tolist(),
            "dropped": stats.dropped.tolist()}


def _all_cases(rank: int, world: int) -> dict:
    cases = {ep: recorded(_case, rank, world, ep) for ep in (4, 2)}
    cases["4_compiled"] = recorded(_case, rank, world, 4, compiled=True)
    return cases


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_cases, 4, timeout=300)


@pytest.mark.parametrize("ep", [4, 2, "4_compiled"])
def test_device_split_dispatch_matches_one_process(results, ep):
    for rank, res in enumerate(results):
        out = res[ep]
        assert "error" not in out, f"rank {rank}: {out.get('error')}"
        assert all(out["finite"].values()), f"rank {rank}: {out['finite']}"
        bad = {k: v for k, v in out["errors"].items() if not v <= RTOL}  # NaN is bad too
        assert not bad, f"rank {rank}: {bad}"
        assert out["routed"] == out["ref_routed"] and sum(out["dropped"]) == 0, out
    assert results[0][ep]["routed"][0] == SIZES[0], "rank 0's tokens must all choose expert 0"
