"""One device mesh for FSDP2, Ulysses sequence parallel and expert parallel.

The world is unflattened (rank order: pp, dp_replicate, dp_shard, sp, tp) into:

- data loading ``[pp, batch, sp, tp]``: ranks of one ``batch`` index read the same samples,
  and the ``sp`` ranks of a batch index each take a contiguous slice of its sequence;
- dense ``[pp, dp_replicate, fsdp, tp]`` with ``fsdp = dp_shard x sp``: sequence-parallel
  ranks co-shard parameters (their gradients are summed by the same reduce-scatter);
- split ``[pp, dp_replicate, dp_shard, sp, tp]``: gives the 1-D ``dp_shard`` mesh (data ranks
  of one SP index);
- sparse ``[pp, dp_replicate, efsdp, ep, etp]`` with ``efsdp x ep = dp_shard x sp``: expert
  parallel borrows its ranks from the FSDP ranks, and experts are FSDP-sharded over efsdp;
- ``loss`` = batch x sp flattened: the ranks over which loss sums and token counts reduce.

FSDP meshes per part (:meth:`OmniParallelDims.part_mesh`) are 1-D (shard) or 2-D (replicate,
shard, i.e. HSDP) so that every gradient is summed over *all* data and sequence ranks whatever
the part's sharding: "fsdp" shards over dp_shard x sp (replicate over dp_replicate);
"dp_shard" shards over dp_shard and replicates over dp_replicate x sp; "none" replicates over
every data rank (shard size 1). Experts use (dp_replicate, efsdp).

Ulysses takes the slot TorchTitan gives context parallel (``cp``), so TorchTitan's own
accounting (tokens per device, FSDP gradient divide factor, EP borrowing) stays right; the
mesh dimension is named ``sp`` and ``get_mesh("cp")`` returns the same mesh.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan.tools.logging import logger

from torchtitan_omni.compat import TitanParallelDims, flatten_mesh, unflatten_mesh
from torchtitan_omni.platform import device_type


class OmniParallelDims(TitanParallelDims):
    """TorchTitan's ``ParallelDims`` with Ulysses sequence parallel as ``sp``."""

    @classmethod
    def from_config(cls, parallelism, world_size: int) -> "OmniParallelDims":
        """Build from a ``[parallelism]`` config section."""
        return cls(
            dp_shard=parallelism.data_parallel_shard_degree,
            dp_replicate=parallelism.data_parallel_replicate_degree,
            cp=parallelism.ulysses_degree,
            tp=parallelism.tensor_parallel_degree,
            pp=parallelism.pipeline_parallel_degree,
            ep=parallelism.expert_parallel_degree,
            etp=parallelism.expert_tensor_parallel_degree,
            world_size=world_size,
        )

    @property
    def sp(self) -> int:
        """Ulysses sequence-parallel degree."""
        return self.cp

    @property
    def sp_enabled(self) -> bool:
        return self.cp > 1

    def mesh_enabled(self, name: str, degree: int) -> bool:
        """Whether dimension ``name`` of size ``degree`` needs a process group."""
        if name in ("sp", "cp"):
            return degree > 1
        return super().mesh_enabled(name, degree)

    def build_mesh(self) -> DeviceMesh:
        """Create every mesh listed in the module docstring."""

        def unflatten(names: tuple[str, ...], sizes: tuple[int, ...]) -> DeviceMesh:
            fake = tuple(n for n, s in zip(names, sizes) if not self.mesh_enabled(n, s))
            return unflatten_mesh(world, sizes, names, fake)

        logger.info(
            f"Building device mesh: pp={self.pp}, dp_replicate={self.dp_replicate}, "
            f"dp_shard={self.dp_shard}, sp={self.sp}, ep={self.ep}"
        )
        world = init_device_mesh(device_type(), (self.world_size,), mesh_dim_names=("world",))
        batch = self.dp_replicate * self.dp_shard
        fsdp = self.dp_shard * self.sp
        efsdp = fsdp * self.tp // (self.etp * self.ep)

        loading = unflatten(("pp", "batch", "sp", "tp"), (self.pp, batch, self.sp, self.tp))
        dense = unflatten(
            ("pp", "dp_replicate", "fsdp", "tp"), (self.pp, self.dp_replicate, fsdp, self.tp)
        )
        sparse = unflatten(
            ("pp", "dp_replicate", "efsdp", "ep", "etp"),
            (self.pp, self.dp_replicate, efsdp, self.ep, self.etp),
        )
        if self.sp > 1 and self.dp_shard > 1:
            split = unflatten(
                ("pp", "dp_replicate", "dp_shard", "sp", "tp"),
                (self.pp, self.dp_replicate, self.dp_shard, self.sp, self.tp),
            )
            dp_shard_mesh = split["dp_shard"]
        elif self.sp > 1:
            dp_shard_mesh = unflatten(
                ("pp", "dp_replicate", "dp_shard", "sp", "tp"),
                (self.pp, self.dp_replicate, self.dp_shard, self.sp, self.tp),
            )["dp_shard"]
        else:
            dp_shard_mesh = dense["fsdp"]
        loss = flatten_mesh(loading["batch", "sp"], "loss")

        global_meshes = {"dataloading": loading, "loss": loss, "dense": dense, "sparse": sparse}
        meshes = {
            "pp": loading["pp"],
            "batch": loading["batch"],
            "loss": loss,
            "dp_replicate": dense["dp_replicate"],
            "fsdp": dense["fsdp"],
            "dp_shard": dp_shard_mesh,
            "sp": loading["sp"],
            "cp": loading["sp"],
            "tp": loading["tp"],
            "ep": sparse["ep"],
            "efsdp": sparse["efsdp"],
            "etp": sparse["etp"],
        }
        self.install_meshes(world, global_meshes, meshes)
        self._check_mesh_sizes()
        return world

    def _check_mesh_sizes(self) -> None:
        expected = {
            "batch": self.dp_replicate * self.dp_shard,
            "loss": self.dp_replicate * self.dp_shard * self.sp,
            "fsdp": self.dp_shard * self.sp,
            "dp_shard": self.dp_shard,
            "sp": self.sp,
            "ep": self.ep,
            "efsdp": self.dp_shard * self.sp * self.tp // (self.etp * self.ep),
        }
        for name, size in expected.items():
            actual = self.named_mesh(name).size()
            if actual != size:
                raise RuntimeError(f"mesh {name!r} has size {actual}, expected {size}")

    # ----------------------------------------------------------------- per-part meshes
    def part_mesh(self, choice: str) -> DeviceMesh | None:
        """The FSDP mesh of a part laid out as ``choice`` ("fsdp", "dp_shard" or "none").

        None when there is a single data rank (nothing to shard or reduce).
        """
        if choice not in ("fsdp", "dp_shard", "none"):
            raise ValueError(f"unknown FSDP mesh {choice!r} (expected fsdp, dp_shard or none)")
        if self.dp_replicate * self.dp_shard * self.sp == 1:
            return None
        if not self.meshes_built:
            self.build_mesh()
        cache = self.__dict__.setdefault("_part_meshes", {})
        if choice not in cache:
            if choice == "fsdp" or (choice == "dp_shard" and self.sp == 1):
                if self.dp_replicate > 1:
                    cache[choice] = self.global_mesh("dense")["dp_replicate", "fsdp"]
                else:
                    cache[choice] = self.named_mesh("fsdp")
            else:
                cache[choice] = self._replicated_mesh(choice)
        return cache[choice]

    def _replicated_mesh(self, choice: str) -> DeviceMesh:
        # Ranks are laid out (dp_replicate, dp_shard, sp) (pp = tp = 1): the replicate dim of
        # "dp_shard" gathers dp_replicate x sp, which is not contiguous, hence an explicit mesh.
        ranks = torch.arange(self.world_size).view(self.dp_replicate, self.dp_shard, self.sp)
        if choice == "dp_shard":
            layout = ranks.permute(0, 2, 1).reshape(self.dp_replicate * self.sp, self.dp_shard)
            names = ("replicate_dp_sp", "dp_shard_only")
        else:
            layout = ranks.reshape(-1, 1)
            names = ("replicate_all", "no_shard")
        return DeviceMesh(device_type(), layout, mesh_dim_names=names)

    def expert_mesh(self) -> DeviceMesh | None:
        """The FSDP mesh of expert-parallel experts: (dp_replicate, efsdp) or efsdp."""
        if self.ep == 1:
            return None
        if not self.meshes_built:
            self.build_mesh()
        if self.dp_replicate > 1:
            return self.global_mesh("sparse")["dp_replicate", "efsdp"]
        return self.named_mesh("efsdp")

    @property
    def seq_len_divisor(self) -> int:
        # Ulysses needs every rank's slice to be equally long.
        return self.sp
