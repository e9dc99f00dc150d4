"""The meshes of a non-colocated job: the LLM's over the LLM ranks, the encoders' over theirs.

With ``[parallelism.parts."encoders.<name>"] ranks = [...]`` the world splits into two
disjoint rank sets (``noncolocated.RankSets``). Each process gets an
:class:`OmniParallelDims` over its own set only, data parallel (FSDP) over that set: the LLM
ranks read the batches, shard the LLM and the decoders, and reduce the losses among
themselves; the encoder ranks shard the encoders among themselves. The two sets meet only on
the world group (the exchange of ``noncolocated``, the combined gradient norm, checkpoints).

``dist.new_group`` is collective over the whole world, even for ranks outside the new group,
so every process creates the same groups in the same order (:func:`rank_set_dims`): the two
sets' groups and one single-rank group per rank (the size-1 dimensions, and the shard
dimension of a replicated part's mesh). The meshes are then made from those groups
(``DeviceMesh.from_group``), which creates no further group.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.tools.logging import logger

from torchtitan_omni.distributed.comm import ProcessGroup
from torchtitan_omni.distributed.noncolocated import RankSets
from torchtitan_omni.distributed.parallel_dims import OmniParallelDims
from torchtitan_omni.distributed.part_layouts import ENCODERS, RANKS_KEY
from torchtitan_omni.platform import device_type, local_device

#: the 1-D meshes TorchTitan and the omni code look up by name
_SET_DIMS = ("batch", "loss", "fsdp", "dp_shard", "efsdp")
_SINGLE_DIMS = ("pp", "dp_replicate", "sp", "cp", "tp", "ep", "etp")


def encoder_ranks_of(parallelism: Any) -> tuple[int, ...]:
    """The encoder ranks the config names (the start-up checks make every encoder's table
    name the same list), or () for colocated encoders."""
    for part, table in (getattr(parallelism, "parts", None) or {}).items():
        if part.startswith(ENCODERS) and RANKS_KEY in table:
            return tuple(int(r) for r in table[RANKS_KEY])
    return ()


class RankSetDims(OmniParallelDims):
    """``OmniParallelDims`` of one rank set: data parallel (``dp_shard``) over the set, every
    other degree 1; its meshes are built from groups made by :func:`rank_set_dims`."""

    rank_sets: RankSets
    #: the global ranks of this process's set, its group, and this rank's single-rank group
    set_ranks: tuple[int, ...]
    set_group: ProcessGroup
    own_group: ProcessGroup

    @property
    def on_encoders(self) -> bool:
        """Whether this process is an encoder rank."""
        return self.rank_sets.on_encoders

    @property
    def dp_enabled(self) -> bool:
        """Data parallel: the LLM ranks read different batches; the encoder ranks read none
        (TorchTitan sizes the data loader and the micro-batch count by this)."""
        return not self.on_encoders and super().dp_enabled

    def build_mesh(self) -> DeviceMesh:
        """Every named mesh TorchTitan's ``get_mesh`` knows, over this set (or this rank)."""
        world = self._mesh(self.set_group, list(self.set_ranks), "world")
        me = dist.get_rank()
        meshes = {name: self._mesh(self.set_group, list(self.set_ranks), name)
                  for name in _SET_DIMS}
        meshes.update({name: self._mesh(self.own_group, [me], name) for name in _SINGLE_DIMS})
        self.install_meshes(world, {}, meshes)
        self._check_mesh_sizes()
        return world

    @staticmethod
    def _mesh(group: ProcessGroup, ranks: list[int], name: str) -> DeviceMesh:
        return DeviceMesh.from_group(group, device_type(), mesh=ranks, mesh_dim_names=(name,))

    def part_mesh(self, choice: str) -> DeviceMesh | None:
        """As ``OmniParallelDims.part_mesh``, over this set; "none" replicates over the set
        with a shard dimension of this rank alone."""
        if choice != "none" or len(self.set_ranks) == 1:
            return super().part_mesh(choice)
        cache = self.__dict__.setdefault("_part_meshes", {})
        if choice not in cache:
            layout = torch.tensor([[r] for r in self.set_ranks])
            cache[choice] = DeviceMesh.from_group(
                [self.set_group, self.own_group], device_type(), mesh=layout,
                mesh_dim_names=("replicate_all", "no_shard"))
        return cache[choice]

    @property
    def global_world_size(self) -> int:
        """Processes of the whole job (both sets)."""
        return len(self.rank_sets.encoders) + len(self.rank_sets.llm)


def rank_set_dims(world_size: int, encoder_ranks: tuple[int, ...]) -> RankSetDims:
    """This process's dims over its rank set (collective: every process calls it once, in
    the same place, after the default process group exists)."""
    encoders = tuple(sorted(encoder_ranks))
    llm = tuple(r for r in range(world_size) if r not in encoders)
    # the same new_group calls in the same order on every process (see the module docstring)
    llm_group = dist.new_group(list(llm))
    encoder_group = dist.new_group(list(encoders))
    singles = [dist.new_group([r]) for r in range(world_size)]
    world = dist.group.WORLD
    assert world is not None  # the default group exists (see the docstring)
    sets = RankSets(encoders, llm, world)
    mine = encoders if sets.on_encoders else llm
    dims = RankSetDims(dp_shard=len(mine), dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1,
                       world_size=len(mine))
    dims.rank_sets = sets
    dims.set_ranks = mine
    dims.set_group = encoder_group if sets.on_encoders else llm_group
    dims.own_group = singles[dist.get_rank()]
    dims.build_mesh()
    logger.info(f"Non-colocated encoders: encoder ranks {list(encoders)}, LLM ranks {list(llm)};"
                f" this rank runs the {'encoders' if sets.on_encoders else 'LLM'}")
    return dims


def agreed_seed(seed: int | None) -> int:
    """``seed``, or one drawn by rank 0 and broadcast over the world (collective). TorchTitan
    draws it the same way only when its ``ParallelDims`` spans more than one rank; with two
    rank sets one may be a single rank, so the job agrees on it first."""
    if seed is not None:
        return seed
    drawn = torch.tensor([int.from_bytes(os.urandom(7), "little")], dtype=torch.int64,
                         device=local_device())
    dist.broadcast(drawn, src=0)
    return int(drawn.item())
