"""``torchtitan_omni.compat`` against the installed TorchTitan, torch and torchdata.

Each private name the adapter relies on must still exist with the signature, attributes or
behaviour used there. A version bump that changes one fails here, naming it, rather than in
the middle of a training run. The last test checks that no other module reaches into them.
"""

import ast
import inspect
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.distributed import ParallelDims

from torchtitan_omni import compat
from torchtitan_omni.config.merge import default_job_config

PACKAGE = Path(compat.__file__).parent


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


# ----------------------------------------------------------------- torch
def test_device_mesh_flatten_and_unflatten_take_what_compat_passes():
    assert _params(DeviceMesh._unflatten)[:5] == [
        "self", "dim", "mesh_sizes", "mesh_dim_names", "backend_override"]
    assert _params(DeviceMesh._flatten)[:3] == ["self", "mesh_dim_name", "backend_override"]


def test_strided_shard_placement():
    p = compat.StridedShard(1, split_factor=2)
    assert (p.dim, p.split_factor) == (1, 2)


def test_grouped_mm_computes_one_product_per_group():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=g)
    w = torch.randn(2, 4, 8, generator=g).transpose(-2, -1)
    out = compat.grouped_mm(x, w, torch.tensor([2, 6], dtype=torch.int32))
    torch.testing.assert_close(out, torch.cat([x[:2] @ w[0], x[2:] @ w[1]]))


def test_foreach_norm_reads_bf16_in_float32():
    """The norm of bf16 tensors read in float32 is the float32 norm of their casts (what
    clipping relies on for the experts' bf16 gradients), not a bf16-rounded one."""
    tensors = [torch.randn(300, 7).bfloat16(), torch.randn(5).bfloat16()]
    wide = compat.foreach_norm(tensors, torch.float32)
    assert [n.dtype for n in wide] == [torch.float32] * 2
    assert all(torch.equal(a, b) for a, b in
               zip(wide, compat.foreach_norm([t.float() for t in tensors], None)))
    assert compat.foreach_norm(tensors, None)[0].dtype == torch.bfloat16


def test_flash_attention_ops_take_what_compat_passes():
    """The varlen flash path (CUDA only, so only the ops' schemas are checked on CPU): the
    positional arguments in order, the keywords it passes, and the outputs it unpacks."""
    fwd = torch.ops.aten._flash_attention_forward.default._schema
    assert [a.name for a in fwd.arguments if not a.kwarg_only] == [
        "query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
        "is_causal", "return_debug_mask"]
    assert {"scale", "window_size_left", "window_size_right"} <= {
        a.name for a in fwd.arguments if a.kwarg_only}
    assert len(fwd.returns) == 5
    bwd = torch.ops.aten._flash_attention_backward.default._schema
    assert [a.name for a in bwd.arguments if not a.kwarg_only] == [
        "grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k",
        "max_q", "max_k", "dropout_p", "is_causal", "rng_state", "unused"]
    assert {"scale", "window_size_left", "window_size_right"} <= {
        a.name for a in bwd.arguments if a.kwarg_only}
    assert len(bwd.returns) == 3


def test_per_op_checkpointing_saves_the_flash_forward():
    """What the flash varlen operator runs in the forward, and the operator itself, are ops
    per-op checkpointing keeps."""
    from torch.utils.checkpoint import CheckpointPolicy

    from torchtitan_omni.distributed.activation_checkpoint import _op_policy

    import torchtitan_omni.modules.attention  # noqa: F401  (registers the operator)

    for op in (torch.ops.aten._flash_attention_forward.default,
               torch.ops.torchtitan_omni.flash_varlen.default):
        assert _op_policy(None, op) == CheckpointPolicy.MUST_SAVE, op
    assert _op_policy(None, torch.ops.torchtitan_omni.flash_varlen_backward.default) == \
        CheckpointPolicy.PREFER_RECOMPUTE


def test_functional_collectives_have_the_signatures_used():
    assert _params(funcol.all_reduce)[:3] == ["self", "reduceOp", "group"]
    assert _params(funcol.all_to_all_single_autograd)[:4] == [
        "self", "output_split_sizes", "input_split_sizes", "group"]
    # compat.all_gather_traceable and reduce_scatter_traceable pass these positionally
    for gather in (funcol.all_gather_tensor, funcol.all_gather_tensor_autograd):
        assert _params(gather)[:3] == ["self", "gather_dim", "group"]
    assert _params(funcol.reduce_scatter_tensor_autograd)[:4] == [
        "self", "reduceOp", "scatter_dim", "group"]
    assert callable(funcol.wait_tensor)
    # compat.all_to_all_launch calls the op itself, positionally
    schema = torch.ops._c10d_functional.all_to_all_single.default._schema
    assert [a.name for a in schema.arguments] == [
        "input", "output_split_sizes", "input_split_sizes", "group_name"]


def test_symmetric_memory_has_what_the_expert_exchange_uses():
    symm_mem = compat.symmetric_memory()
    assert symm_mem is not None
    for name in ("empty", "rendezvous", "set_backend", "get_backend", "is_nvshmem_available"):
        assert callable(getattr(symm_mem, name)), name
    schema = torch.ops.symm_mem.all_to_all_vdev.default._schema
    assert [a.name for a in schema.arguments] == [
        "input", "out", "in_splits", "out_splits_offsets", "group_name"]


def test_dynamo_recompile_limit_and_graph_counter():
    before = torch._dynamo.config.cache_size_limit
    try:
        compat.raise_recompile_limit(before + 3)
        assert torch._dynamo.config.cache_size_limit == before + 3
        compat.raise_recompile_limit(1)  # never lowers it
        assert torch._dynamo.config.cache_size_limit == before + 3
    finally:
        torch._dynamo.config.cache_size_limit = before
    assert isinstance(compat.compiled_graph_count(), int)


def test_mark_size_static_keeps_one_size_constant_in_a_dynamic_compile():
    """Two sizes through a ``dynamic=True`` compile: one graph unmarked, two marked."""
    from torch._dynamo.utils import counters

    def double(x):
        return x * 2

    for mark, graphs in ((False, 1), (True, 2)):
        torch._dynamo.reset()
        counters.clear()
        fn = torch.compile(double, backend="eager", dynamic=True)
        for n in (6, 10):
            x = torch.ones(n)
            if mark:
                compat.mark_size_static(x)
            assert torch.equal(fn(x), x * 2)
        assert counters["stats"]["unique_graphs"] == graphs, (mark, dict(counters["stats"]))


def test_forward_hooks_are_seen_own_and_global():
    lin = nn.Linear(2, 2)
    assert not compat.has_forward_hooks(lin)
    handle = lin.register_forward_pre_hook(lambda m, a: None)
    assert compat.has_forward_hooks(lin)
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    try:
        assert compat.has_forward_hooks(lin)
    finally:
        handle.remove()
    assert not compat.has_forward_hooks(lin)


def test_persistent_buffers_are_those_of_the_state_dict():
    m = nn.Module()
    m.register_buffer("kept", torch.zeros(1))
    m.register_buffer("dropped", torch.zeros(1), persistent=False)
    m.register_buffer("empty", None)
    assert [n for n, _ in compat.persistent_buffers(m)] == ["kept"] == list(m.state_dict())


# ----------------------------------------------------------------- TorchTitan
class _Mesh:
    """A stand-in for a built mesh: what ``get_optional_mesh`` reads of one."""

    def __init__(self, names: tuple[str, ...], size: int) -> None:
        self.mesh_dim_names, self._size = names, size
        self.ndim = len(names)

    def size(self) -> int:
        return self._size

    def __getitem__(self, names):
        return ("sliced", names)


def test_parallel_dims_registry_is_what_get_mesh_reads():
    assert _params(ParallelDims._mesh_exist) == ["self", "name", "degree"]
    fields = {f.name for f in ParallelDims.__dataclass_fields__.values()}
    assert {"_meshes", "_world_mesh"} <= fields

    class Dims(compat.TitanParallelDims):
        def mesh_enabled(self, name, degree):
            return name != "off" and degree > 1

    dims = Dims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=2)
    assert not dims.meshes_built
    fsdp, off = _Mesh(("fsdp",), 2), _Mesh(("off",), 2)
    dense = _Mesh(("dp_replicate", "fsdp"), 2)
    dims.install_meshes("world", {"dense": dense}, {"fsdp": fsdp, "off": off,
                                                    "dp_replicate": _Mesh(("dp_replicate",), 2)})
    assert dims.meshes_built and dims.world_mesh == "world"
    assert dims.get_mesh("fsdp") is fsdp and dims.named_mesh("off") is off
    assert dims.get_optional_mesh("off") is None  # TorchTitan asks our mesh_enabled
    assert dims.get_mesh(["dp_replicate", "fsdp"]) == ("sliced", ("dp_replicate", "fsdp"))
    assert dims.global_mesh("dense") is dense


def test_checkpoint_manager_hooks_and_attributes(tmp_path):
    assert _params(CheckpointManager._purge_stale_checkpoints) == ["self"]
    assert _params(CheckpointManager._async_wait) == ["self"]
    assert "self._purge_stale_checkpoints()" in inspect.getsource(CheckpointManager.save)
    cfg = default_job_config().checkpoint
    cfg.enable, cfg.keep_latest_k, cfg.folder = True, 2, "ckpt"

    class Manager(compat.TitanCheckpointManager):
        purged = 0

        def purge_stale_checkpoints(self):
            self.purged += 1

    manager = Manager(dataloader=None, model_parts=[nn.Linear(2, 2)], optimizers=None,
                      lr_schedulers=None, states={}, checkpoint_config=cfg, sd_adapter=None,
                      base_folder=str(tmp_path))
    try:
        manager._purge_stale_checkpoints()  # what TorchTitan's save calls
        assert manager.purged == 1
        manager.wait_for_async_save()  # nothing in flight
        # the attributes OmniCheckpointManager reads
        for name in ("enable", "folder", "keep_latest_k", "purge_queue", "load_only", "states",
                     "initial_load_path", "initial_load_model_only", "exclude_from_loading",
                     "save_future"):
            assert hasattr(manager, name), name
        assert manager.folder == str(tmp_path / "ckpt")
    finally:
        manager.close()


class _Counting(IterableDataset):
    """Yields 0, 1, 2, ...; its state is the next value."""

    def __init__(self) -> None:
        self.next = 0

    def __iter__(self):
        while True:
            self.next += 1
            yield self.next - 1

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]


def test_titan_loader_state_key():
    loader = ParallelAwareDataloader(_Counting(), dp_rank=3, dp_world_size=4, batch_size=None)
    assert compat.loader_state_key(loader) == compat.loader_state_key_of_rank(3)
    assert compat.loader_state_key_of_rank(3) in loader.state_dict()


@pytest.mark.parametrize("workers", [0, 1])
def test_stateful_dataloader_state_layout(workers):
    loader = StatefulDataLoader(_Counting(), batch_size=None, num_workers=workers)
    it = iter(loader)
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    state = loader.state_dict()
    assert compat.loader_worker_count(state) == workers
    assert compat.loader_steps_since_snapshot(state) == 0
    states = compat.loader_dataset_states(pickle.loads(pickle.dumps(state)))
    assert states == [{"next": 3}] * max(workers, 1)
    assert compat.loader_dataset_states({"unknown": 1}) is None


def test_restart_loader_from_dataset_ignores_a_loaded_state():
    loader = StatefulDataLoader(_Counting(), batch_size=None)
    loader.load_state_dict({**StatefulDataLoader(_Counting(), batch_size=None).state_dict()})
    loader.dataset.load_state_dict({"next": 7})
    compat.restart_loader_from_dataset(loader)
    assert next(iter(loader)) == 7


# ----------------------------------------------------------------- nobody else
def test_no_other_module_imports_private_torch_or_titan_names():
    """Private modules or names of torch, TorchTitan and torchdata are imported only by
    ``compat`` (attribute accesses are linted by ruff's SLF001)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] in ("torch", "torchtitan", "torchdata") and any(
                        p.startswith("_") for p in parts[1:]):
                    offenders.append(f"{path.relative_to(PACKAGE.parent)}: {name}")
    assert not offenders, "private imports outside compat.py:\n" + "\n".join(offenders)
