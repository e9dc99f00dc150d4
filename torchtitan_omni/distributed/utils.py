"""Small collective helpers used by the trainer: reductions over a mesh (of device tensors, or
of host tensors without waiting for the device), the MoE routing counts' reduction, and
gradient-norm clipping over parameters that live on different meshes
(encoders, LLM and experts may each be sharded differently)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan_omni.compat import all_reduce_traceable, flatten_mesh, foreach_norm
from torchtitan_omni.platform import local_device


def all_reduce(tensor: torch.Tensor, mesh: DeviceMesh | None, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` over ``mesh`` (all of its dimensions); identity when ``mesh`` is None."""
    if mesh is None:
        return tensor
    group = mesh if mesh.ndim == 1 else flatten_mesh(mesh)
    return all_reduce_traceable(tensor, op, group)


#: gloo groups by the ranks they span (made on first use; device groups over the same ranks,
#: such as the loss and batch meshes', share one)
_HOST_GROUPS: dict[tuple[int, ...], ProcessGroup] = {}


def host_group(group: ProcessGroup) -> ProcessGroup:
    """A gloo group over ``group``'s ranks (``group`` itself when it is gloo already), for
    exchanging host values without waiting for the device. Why: a collective over NCCL moves
    device memory, and reading its result on the host waits for every kernel queued before
    it; at the start of a step that empties the GPU's queue, so the launch-bound encoder phase
    after it runs with the GPU idle. Every rank of ``group`` must call this together the
    first time (it makes the group)."""
    if "gloo" in str(dist.get_backend(group)):
        return group
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _HOST_GROUPS:
        # only these ranks take part in making the gloo group (rank sets: the LLM ranks
        # agree among themselves while the encoder ranks serve); torch names such a group
        # by its ranks, so one per rank set
        _HOST_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo",
                                             use_local_synchronization=True)
    return _HOST_GROUPS[ranks]


def all_reduce_on_host(tensor: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """The sum of a host tensor over ``mesh``'s ranks, as a new host tensor, exchanged through
    gloo (:func:`host_group`): the per-step agreement (target counts, which modalities some
    rank carries) is about host values, and the host never waits for the device. Identity
    when ``mesh`` is None."""
    out = tensor.clone()
    if mesh is None:
        return out
    dist.all_reduce(out, group=host_group((mesh if mesh.ndim == 1 else flatten_mesh(mesh))
                                          .get_group()))
    return out


def all_reduce_world(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` in place over every process (the default group), e.g. where a mesh
    spans one rank set only (non-colocated encoders)."""
    dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return tensor


def reduce_moe_counts(counts: torch.Tensor, ep_mesh: DeviceMesh | None,
                      all_mesh: DeviceMesh | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing counts ``[2, layers, experts]`` (routed, dropped) of this rank ->
    ``[layers, experts]`` routed copies summed over the expert-parallel group (the tokens each
    expert's rank computes) and ``[2, layers]`` routed and dropped copies summed over
    ``all_mesh`` (every rank). Two reductions, on the counts' device (the caller reads them on
    the host: ``components.deferred_read``)."""
    routed, dropped = counts[0], counts[1]
    loads = all_reduce(routed, ep_mesh)
    totals = all_reduce(torch.stack([routed.sum(-1), dropped.sum(-1)]), all_mesh)
    return loads, totals


def _local_grads(parameters: Iterable[torch.Tensor],
                 held: Mapping[torch.Tensor, torch.Tensor] | None = None
                 ) -> dict[tuple[DeviceMesh, tuple] | None, list[torch.Tensor]]:
    """The gradients' local tensors by the (mesh, placements) of their DTensors (None: plain
    tensors); ``held`` as in :func:`grad_norm_and_clip_coef`, laid out as their
    parameters."""
    groups: dict[tuple[DeviceMesh, tuple] | None, list[torch.Tensor]] = defaultdict(list)
    for p in parameters:
        g = p.grad
        if g is None and held and p in held:
            key = (p.device_mesh, p.placements) if isinstance(p, DTensor) else None
            groups[key].append(held[p])
            continue
        if g is None:
            continue
        if isinstance(g, DTensor):
            groups[(g.device_mesh, g.placements)].append(g.to_local())
        else:
            groups[None].append(g)
    return groups


@torch.no_grad()
def grad_norm_and_clip_coef(parameters: Iterable[torch.Tensor], max_norm: float,
                            combine: Callable[[torch.Tensor], torch.Tensor] | None = None,
                            held: Mapping[torch.Tensor, torch.Tensor] | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The global L2 norm of all gradients and the coefficient that clips it to ``max_norm``
    (``torch.nn.utils.clip_grads_with_norm_``'s: at most 1), both device scalars; the
    gradients are left as they are.

    Works on the gradients' local shards: each group of gradients with the same (mesh,
    placements) sums its local squares in one foreach kernel and completes the sum over the
    mesh dimensions it is sharded on (one all-reduce each). Why not on the DTensors: DTensor's
    dispatch of the foreach norm checks every tensor on the host (15 ms for LLaMA#Omni 8B's
    226 tensors a rank), while the GPU waits. ``combine`` maps the sum of squares to the job's
    (non-colocated encoders: ``noncolocated.combine_grad_norms`` adds the other rank set's),
    so every rank clips by the same norm. ``held``: parameter -> its gradient's local tensor,
    for parameters whose gradient is held elsewhere (``.grad`` None: the experts' gradients
    in their compute copies, ``components.compute_copies``); a gradient in a lower precision
    than float32 is normed in float32.
    """
    return _norm_and_clip_coef(_local_grads(parameters, held), max_norm, combine)


def _l2_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    # torch.nn.utils.get_total_norm's (a foreach norm per device and dtype, then the norm of
    # the tensors' norms), with a precision below float32 normed in float32 (torch's would
    # round each tensor's norm to bf16; a bf16 gradient's norm read in float32 is its float32
    # cast's, bit for bit), and the tensors' norms kept in the tensors' order: grouped by
    # dtype, the norm of the norms would add them in another order than the casts' would
    by_kind: dict[tuple, list[int]] = defaultdict(list)
    for i, g in enumerate(grads):
        by_kind[(g.device, g.dtype)].append(i)
    norms: list[torch.Tensor] = [torch.empty(())] * len(grads)
    for (_, dtype), indices in by_kind.items():
        wider = torch.float32 if dtype.itemsize < 4 and dtype.is_floating_point else None
        for i, norm in zip(indices, foreach_norm([grads[i] for i in indices], wider)):
            norms[i] = norm
    first = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), 2.0)


def _norm_and_clip_coef(groups: dict[tuple[DeviceMesh, tuple] | None, list[torch.Tensor]],
                        max_norm: float,
                        combine: Callable[[torch.Tensor], torch.Tensor] | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    # grad_norm_and_clip_coef on local gradients already grouped (_local_grads)
    if not groups and combine is None:
        return torch.zeros(()), torch.ones(())
    squares = [torch.zeros((), dtype=torch.float32, device=local_device())]
    for key, grads in groups.items():
        square = _l2_norm(grads).float() ** 2
        if key is not None:
            mesh, placements = key
            for dim, placement in enumerate(placements):
                # sharded (strided too: not a Shard in torch 2.13) or partial: sum
                if not placement.is_replicate():
                    square = all_reduce_traceable(square, "sum", (mesh, dim))
        squares.append(square)
    device = squares[-1].device
    square = torch.stack([s.to(device) for s in squares]).sum()
    total = (combine(square) if combine is not None else square).sqrt()
    return total, (max_norm / (total + 1e-6)).clamp(max=1.0)


@torch.no_grad()
def scale_grads_(grads: Iterable[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply local gradient tensors in place by the device scalar ``coef`` (one foreach
    kernel per device and dtype)."""
    by_kind: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        by_kind[(g.device, g.dtype)].append(g)
    for (grad_device, _), same in by_kind.items():
        torch._foreach_mul_(same, coef.to(grad_device))


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float,
                    combine: Callable[[torch.Tensor], torch.Tensor] | None = None
                    ) -> torch.Tensor:
    """Clip the global L2 norm of all gradients to ``max_norm``; returns the norm before
    (:func:`grad_norm_and_clip_coef`, then the local shards multiplied in place)."""
    groups = _local_grads(parameters)
    total, coef = _norm_and_clip_coef(groups, max_norm, combine)
    scale_grads_([g for grads in groups.values() for g in grads], coef)
    return total


def barrier() -> None:
    """Barrier on the default group (no-op when not distributed)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
