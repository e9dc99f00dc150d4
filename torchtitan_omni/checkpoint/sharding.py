"""Which part of a full tensor this rank holds, as index ranges per dimension.

A DTensor's local shard is ``full[ix_0][:, ix_1]...`` for one index set per dimension; each set
depends only on the placements that shard that dimension (``Shard(d)`` chunks it,
``_StridedShard(d)`` chunks it right-to-left as FSDP2 does over an already sharded tensor, and
``Replicate`` keeps it). We find each set by sharding a small ``arange`` probe with the same
placements (local splitting only, no communication), so every layout DTensor can express
(FSDP, HSDP, FSDP over expert-parallel experts, uneven chunks, empty shards) is covered by the
same code that DTensor itself uses.

The sets are returned as runs of contiguous indices, which map onto safetensors slicing and
DCP reads.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Partial

from torchtitan_omni.compat import StridedShard

Runs = list[tuple[int, int]]


def _probe_placements(placements, dim: int) -> list:
    """``placements`` as seen by a 1-D probe of tensor dimension ``dim``."""
    out = []
    for p in placements:
        # _StridedShard is a Shard subclass on older torch and not on newer: test it first.
        if isinstance(p, StridedShard):
            out.append(
                StridedShard(0, split_factor=p.split_factor) if p.dim == dim else Replicate()
            )
        elif isinstance(p, Shard):
            out.append(Shard(0) if p.dim == dim else Replicate())
        elif isinstance(p, Partial):
            raise ValueError(f"a Partial placement has no local slice to load ({placements})")
        else:
            out.append(Replicate())
    return out


def local_indices(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Per dimension, the (sorted) global indices of this rank's local tensor (int64, CPU)."""
    if not isinstance(tensor, DTensor):
        return [torch.arange(n) for n in tensor.shape]
    mesh = tensor.device_mesh
    out = []
    for dim, size in enumerate(tensor.shape):
        placements = _probe_placements(tensor.placements, dim)
        if all(isinstance(p, Replicate) for p in placements):
            out.append(torch.arange(size))
            continue
        probe = torch.arange(size, device=mesh.device_type)
        local = distribute_tensor(probe, mesh, placements, src_data_rank=None).to_local()
        out.append(local.cpu())
    return out


def runs_of(indices: torch.Tensor) -> Runs:
    """Contiguous ``[start, stop)`` runs of an index set (in the given order)."""
    if indices.numel() == 0:
        return []
    values = indices.tolist()
    runs = []
    start = prev = values[0]
    for v in values[1:]:
        if v != prev + 1:
            runs.append((start, prev + 1))
            start = v
        prev = v
    runs.append((start, prev + 1))
    return runs


def local_runs(tensor: torch.Tensor) -> list[Runs]:
    """Per dimension, the contiguous index runs of this rank's part of ``tensor``."""
    return [runs_of(ix) for ix in local_indices(tensor)]


def local_shape(runs: list[Runs]) -> tuple[int, ...]:
    """Shape of the block the runs describe."""
    return tuple(sum(b - a for a, b in r) for r in runs)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The storage of this rank's part: ``to_local()`` for DTensors, the tensor otherwise."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
