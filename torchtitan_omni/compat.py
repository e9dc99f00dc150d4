"""The one module that reaches into private APIs of TorchTitan 0.2.2, torch and torchdata.

Everything else in ``torchtitan_omni`` uses public names only; what has no public equivalent in
the pinned versions is wrapped here, each use documented with why. ``tests/test_compat.py``
checks that every private name used here still exists with the signature or attributes this
module relies on, so an upgrade of TorchTitan, torch or torchdata fails there, naming the name,
instead of deep inside a training run.

Wrapped here:

- torch: ``DeviceMesh._unflatten`` / ``_flatten`` (the mesh layout TorchTitan's own
  ``ParallelDims`` builds with), DTensor's ``_StridedShard`` placement, ``torch._grouped_mm``
  (grouped GEMM of the MoE experts), ``torch._foreach_norm`` with a ``dtype`` (clipping's
  norm of bf16 gradients in float32), ``aten._flash_attention_forward`` / ``_backward``
  (FlashAttention-2's varlen kernels without ``varlen_attn``'s custom-op layers: packed
  attention on CUDA), ``torch.distributed._functional_collectives`` and its
  op ``torch.ops._c10d_functional.all_to_all_single`` (collectives ``torch.compile`` can
  trace; a launched one waited where the caller chooses),
  ``torch._dynamo`` (recompile limit, compiled-graph count, a size kept static in a
  dynamic-shape compile), ``nn.Module``'s hook and
  non-persistent-buffer registries; ``torch.distributed._symmetric_memory`` (NVSHMEM buffers)
  and its op ``torch.ops.symm_mem.all_to_all_vdev`` (the expert exchange with split sizes on
  the device, ``distributed.expert_device_splits``);
- TorchTitan: ``ParallelDims``' mesh registry (``_meshes``, ``_global_meshes``,
  ``_world_mesh``) and its ``_mesh_exist`` hook; ``CheckpointManager``'s
  ``_purge_stale_checkpoints`` hook and ``_async_wait``; ``ParallelAwareDataloader._rank_id``;
- torchdata: the layout of a ``StatefulDataLoader`` state (dataset state per worker) and the
  attributes that make it start over from its dataset.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo.utils import counters as dynamo_counters
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import _StridedShard
from torchdata.stateful_dataloader.incremental_state import _DATASET_STATE
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.distributed import ParallelDims

# ----------------------------------------------------------------- torch: device meshes


def unflatten_mesh(mesh: DeviceMesh, sizes: tuple[int, ...], names: tuple[str, ...],
                   fake: tuple[str, ...] = ()) -> DeviceMesh:
    """``mesh``'s (1-D) dimension split into ``names`` of ``sizes``; the dimensions in ``fake``
    get no process group. torch 2.13 has no public unflatten; TorchTitan builds its meshes the
    same way."""
    return mesh._unflatten(0, sizes, names, backend_override=dict.fromkeys(fake, "fake"))


def flatten_mesh(mesh: DeviceMesh, name: str | None = None) -> DeviceMesh:
    """All dimensions of ``mesh`` as one (a process group over all its ranks)."""
    return mesh._flatten(name) if name is not None else mesh._flatten()


#: the placement FSDP2 gives a dimension it shards over one already sharded (expert-parallel
#: experts, HSDP): chunks taken right-to-left; torch 2.13 exports no public name for it
StridedShard = _StridedShard


# ----------------------------------------------------------------- torch: kernels, collectives


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm``: one GEMM per group of rows of ``a`` (CUDA bf16). Looked up at
    call time, so a test can count calls at torch's entry point."""
    return torch._grouped_mm(a, b, offs=offs)


def foreach_norm(tensors: list[torch.Tensor], dtype: torch.dtype | None) -> list[torch.Tensor]:
    """``torch._foreach_norm``: each tensor's L2 norm in one kernel per chunk list, read and
    accumulated in ``dtype`` (None: the tensors'), as ``torch.nn.utils.get_total_norm`` uses
    it without a dtype (which rounds a bf16 tensor's norm to bf16)."""
    return list(torch._foreach_norm(tensors, 2.0, dtype=dtype))


def flash_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                         max_seqlen: int, causal: bool, scale: float | None
                         ) -> tuple[torch.Tensor, ...]:
    """``aten._flash_attention_forward`` on packed ``[T, H, D]`` q/k/v (k/v may have fewer
    heads: the kernel serves grouped queries itself), no dropout: ``(out, logsumexp,
    rng_state, unused)``, the last three what :func:`flash_varlen_backward` needs.

    The op ``torch.nn.attention.varlen.varlen_attn`` runs inside its custom ops. Called
    directly, a pass costs a third to two thirds less host time and no extra kernel
    (``scripts/bench_attention.py``'s ``varlen_aten`` row, docs/performance.md)."""
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, causal, False, scale=scale,
        window_size_left=-1, window_size_right=0 if causal else -1)
    return out, lse, rng, unused


def flash_varlen_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, rng: torch.Tensor,
                          unused: torch.Tensor, cu: torch.Tensor, max_seqlen: int, causal: bool,
                          scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten._flash_attention_backward`` for :func:`flash_varlen_forward`: ``(dq, dk, dv)``,
    ``dk``/``dv`` with the heads of ``k``/``v``."""
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        grad, q, k, v, out, lse, cu, cu, max_seqlen, max_seqlen, 0.0, causal, rng, unused,
        scale=scale, window_size_left=-1, window_size_right=0 if causal else -1)
    return dq, dk, dv


def symmetric_memory():
    """``torch.distributed._symmetric_memory`` (symmetric buffers: ``empty``, ``rendezvous``,
    ``set_backend``/``get_backend``, ``is_nvshmem_available``), or None where torch has none.
    Its all-to-all-v op is :func:`all_to_all_vdev`."""
    try:
        import torch.distributed._symmetric_memory as symm_mem  # noqa: PLC0415 (optional)
    except ImportError:
        return None
    return symm_mem


def all_to_all_vdev(send, recv, in_splits, out_splits_offsets, group_name: str) -> None:
    """NVSHMEM all-to-all-v with the split sizes on the device: ``in_splits[j]`` rows of
    ``send`` to rank ``j``; what arrives lands in ``recv`` in rank order, its sizes and offsets
    in ``out_splits_offsets`` ``[2, ranks]`` (every tensor a rendezvoused symmetric buffer)."""
    torch.ops.symm_mem.all_to_all_vdev(send, recv, in_splits, out_splits_offsets, group_name)


def all_reduce_traceable(tensor: torch.Tensor, op: str, group) -> torch.Tensor:
    """All-reduce through torch's functional collectives (traced by ``torch.compile``)."""
    return funcol.all_reduce(tensor, reduceOp=op, group=group)


def all_gather_traceable(tensor: torch.Tensor, group: dist.ProcessGroup,
                         differentiable: bool = True) -> torch.Tensor:
    """Every rank's ``tensor`` stacked along dim 0 in rank order, through torch's functional
    collectives (traced by ``torch.compile``); ``differentiable``: its backward reduce-scatters
    the gradient."""
    gather = funcol.all_gather_tensor_autograd if differentiable else funcol.all_gather_tensor
    return funcol.wait_tensor(gather(tensor, 0, group))


def reduce_scatter_traceable(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``tensor`` summed over the ranks, each keeping its block of dim 0 (rank order), through
    torch's functional collectives (traced by ``torch.compile``); its backward all-gathers the
    gradient."""
    return funcol.wait_tensor(funcol.reduce_scatter_tensor_autograd(tensor, "sum", 0, group))


def all_to_all_traceable(tensor: torch.Tensor, group: dist.ProcessGroup,
                         out_splits: list[int] | None = None,
                         in_splits: list[int] | None = None) -> torch.Tensor:
    """All-to-all of dim 0 (even, or by the given split sizes) through torch's functional
    collectives: differentiable (its backward is the reverse exchange) and traced by
    ``torch.compile``."""
    return funcol.wait_tensor(
        funcol.all_to_all_single_autograd(tensor, out_splits, in_splits, group))


def all_to_all_launch(tensor: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """Even all-to-all of dim 0 over the group named ``group_name`` (``world`` ranks), launched
    and not waited, outside autograd: torch's functional collective op itself (traced by
    ``torch.compile``). The public wrapper hides the pending result in eager mode (an
    ``AsyncCollectiveTensor`` waiting at its first use) and waits at once when traced; the op
    lets the caller choose where the wait goes. Read the result only through
    :func:`collective_wait`."""
    splits = [tensor.shape[0] // world] * world
    return torch.ops._c10d_functional.all_to_all_single(tensor, splits, splits, group_name)


def collective_wait(tensor: torch.Tensor) -> torch.Tensor:
    """Wait for the collective writing ``tensor`` (from :func:`all_to_all_launch`); returns
    the result (blocks on CPU, orders streams on CUDA)."""
    return funcol.wait_tensor(tensor)


def raise_recompile_limit(limit: int) -> None:
    """Let dynamo keep at least ``limit`` compiled variants per code object (no public
    setting in torch 2.13)."""
    config = torch._dynamo.config
    config.cache_size_limit = max(config.cache_size_limit, limit)


def mark_size_static(tensor: torch.Tensor, dim: int = 0) -> None:
    """Have a ``dynamic=True`` compile treat ``tensor``'s size ``dim`` as a constant (a graph
    per size); other inputs stay symbolic. torch 2.13 has no public mark."""
    torch._dynamo.mark_static(tensor, dim)


def compiled_graph_count() -> int:
    """Graphs dynamo has compiled in this process (dynamo's own counter)."""
    return int(dynamo_counters["stats"].get("unique_graphs", 0))


# ----------------------------------------------------------------- torch: nn.Module internals


def has_forward_hooks(module: nn.Module) -> bool:
    """Whether a forward (pre-)hook would run around ``module``: its own or a global one.
    ``nn.Module`` exposes no public query."""
    return bool(module._forward_hooks or module._forward_pre_hooks
                or nn.modules.module._global_forward_hooks
                or nn.modules.module._global_forward_pre_hooks)


def persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``module``'s own buffers that go into its state dict (no recursion). ``named_buffers``
    cannot tell persistent from non-persistent ones."""
    for name, buf in module._buffers.items():
        if buf is not None and name not in module._non_persistent_buffers_set:
            yield name, buf


# ----------------------------------------------------------------- TorchTitan: ParallelDims


class TitanParallelDims(ParallelDims):
    """TorchTitan's ``ParallelDims`` with its private mesh registry behind public names.

    TorchTitan's ``get_mesh``/``get_optional_mesh`` read ``_meshes`` and ``_global_meshes``,
    which its own ``build_mesh`` fills; a subclass that builds other meshes installs them with
    :meth:`install_meshes`, and decides which dimensions get process groups with
    :meth:`mesh_enabled` (TorchTitan's ``_mesh_exist`` hook).
    """

    def mesh_enabled(self, name: str, degree: int) -> bool:
        """Whether dimension ``name`` of size ``degree`` needs a process group."""
        return super()._mesh_exist(name, degree)

    def _mesh_exist(self, name: str, degree: int) -> bool:  # TorchTitan's hook
        return self.mesh_enabled(name, degree)

    def install_meshes(self, world: DeviceMesh, global_meshes: dict[str, DeviceMesh],
                       meshes: dict[str, DeviceMesh]) -> None:
        """Make ``meshes`` (1-D, by name) and ``global_meshes`` (multi-dimensional) what
        TorchTitan's ``get_mesh``/``get_optional_mesh`` return."""
        self._world_mesh = world
        self._global_meshes = global_meshes
        self._meshes = meshes

    @property
    def meshes_built(self) -> bool:
        """Whether the meshes exist (``build_mesh`` ran)."""
        return bool(self._meshes)

    def named_mesh(self, name: str) -> DeviceMesh:
        """The built 1-D mesh ``name``, whatever its size (``get_mesh`` refuses size 1)."""
        return self._meshes[name]

    def global_mesh(self, name: str) -> DeviceMesh:
        """The built multi-dimensional mesh ``name`` (e.g. "dense", "sparse")."""
        return self._global_meshes[name]


# ----------------------------------------------------------------- TorchTitan: CheckpointManager


class TitanCheckpointManager(CheckpointManager):
    """TorchTitan's ``CheckpointManager`` with its private hooks behind public names.

    TorchTitan's ``save`` calls ``_purge_stale_checkpoints`` after each save: a subclass
    overrides :meth:`purge_stale_checkpoints` instead. :meth:`wait_for_async_save` waits for an
    asynchronous save in flight (``_async_wait``).
    """

    def purge_stale_checkpoints(self) -> None:
        """Queue the checkpoints to delete after a save (TorchTitan's default policy)."""
        super()._purge_stale_checkpoints()

    def _purge_stale_checkpoints(self) -> None:  # TorchTitan's hook
        self.purge_stale_checkpoints()

    def wait_for_async_save(self) -> None:
        """Block until an asynchronous save in flight has finished (no-op without one)."""
        self._async_wait()


# ----------------------------------------------------------------- TorchTitan / torchdata: loader

#: keys of a ``StatefulDataLoader`` state (torchdata 0.11): with loader workers, the worker
#: snapshot and the batches taken since it; without, the count of batches yielded
_SNAPSHOT, _WORKER_SNAPSHOTS = "_snapshot", "_worker_snapshots"
_STEPS_SINCE, _NUM_YIELDED = "_steps_since_snapshot", "_num_yielded"


def loader_state_key(loader: ParallelAwareDataloader) -> str:
    """The key under which TorchTitan's loader keeps this data rank's state."""
    return loader._rank_id


def loader_state_key_of_rank(dp_rank: int) -> str:
    """The key of data rank ``dp_rank``'s state in TorchTitan's loader state dicts (the same
    pattern as :func:`loader_state_key`; the test checks they agree)."""
    return f"dp_rank_{dp_rank}"


def loader_worker_count(state: dict[str, Any]) -> int:
    """Loader workers of a ``StatefulDataLoader`` state (0: loaded in the main process)."""
    return len(state[_SNAPSHOT][_WORKER_SNAPSHOTS]) if _SNAPSHOT in state else 0


def loader_steps_since_snapshot(state: dict[str, Any]) -> int:
    """Batches taken after the workers' last snapshot (their rows are in no dataset state)."""
    return int(state.get(_STEPS_SINCE, 0)) if _SNAPSHOT in state else 0


def loader_dataset_states(state: dict[str, Any]) -> list[Any] | None:
    """The dataset state of each loader worker (one entry without workers) in a
    ``StatefulDataLoader`` state; None when the state has another layout."""
    if _SNAPSHOT in state:
        workers = state[_SNAPSHOT][_WORKER_SNAPSHOTS]
        return [workers[f"worker_{w}"].get(_DATASET_STATE) for w in range(len(workers))]
    if _NUM_YIELDED in state:
        return [state.get(_DATASET_STATE)]
    return None


def restart_loader_from_dataset(loader: ParallelAwareDataloader) -> None:
    """Make the next iteration of ``loader`` start from its dataset's current state, not from
    a ``StatefulDataLoader`` state loaded before (no public reset in torchdata 0.11)."""
    loader._iterator = None
    loader._initial_iter_for_state_dict = False
    loader.next_iter_state = None
