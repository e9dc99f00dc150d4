"""``distributed.utils.all_reduce_on_host``: the per-step agreement on host values (target
counts, which modalities some rank carries) summed over a mesh through gloo, on the mesh's own
group where that is gloo and on a gloo twin of it where the mesh's group is device-only (NCCL;
stood in for on CPU by reporting the group's backend as "nccl")."""

from __future__ import annotations

from unittest import mock

import torch

from tests.harness import run_distributed


def _sum_over_meshes(rank: int, world: int, pretend_nccl: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from torchtitan_omni.distributed import utils

    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("loss",))
    grid = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "sp"))
    # another device group over the same ranks (as the trainer's loss and batch meshes)
    other = DeviceMesh.from_group(dist.new_group(list(range(world))), "cpu",
                                  mesh_dim_names=("batch",))
    real_backend = dist.get_backend
    fake = (lambda group=None: "nccl") if pretend_nccl else real_backend
    with mock.patch.object(utils.dist, "get_backend", side_effect=fake):
        local = torch.tensor([rank + 1, 10 * rank, 1], dtype=torch.long)
        before = local.clone()
        out_flat = utils.all_reduce_on_host(local, flat)
        out_grid = utils.all_reduce_on_host(local, grid)
        out_other = utils.all_reduce_on_host(local, other)
        twins = dict(utils._HOST_GROUPS)
        again = utils.all_reduce_on_host(local, flat)
        twins_after = dict(utils._HOST_GROUPS)
    return {"flat": out_flat.tolist(), "grid": out_grid.tolist(), "again": again.tolist(),
            "other": out_other.tolist(),
            "unchanged": torch.equal(local, before), "device": out_flat.device.type,
            "twins": len(twins), "twins_reused": twins == twins_after,
            "none": utils.all_reduce_on_host(local, None).tolist()}


def _expected(world: int) -> list[int]:
    return [sum(r + 1 for r in range(world)), sum(10 * r for r in range(world)), world]


def _both(rank: int, world: int) -> tuple[dict, dict]:
    # one spawn for both cases (the gloo twins of the second are made after the first's calls)
    return _sum_over_meshes(rank, world, False), _sum_over_meshes(rank, world, True)


def test_host_values_summed_over_the_mesh_and_device_only_groups_get_a_gloo_twin():
    for rank, (gloo, nccl) in enumerate(run_distributed(_both, 2)):
        assert gloo["flat"] == gloo["grid"] == gloo["again"] == gloo["other"] == _expected(2)
        assert gloo["unchanged"] and gloo["device"] == "cpu"
        assert gloo["twins"] == 0, "a gloo mesh needs no twin group"
        assert gloo["none"] == [rank + 1, 10 * rank, 1]
        assert nccl["flat"] == nccl["grid"] == nccl["again"] == nccl["other"] == _expected(2)
        # one gloo group for the three device groups over the same ranks, made once and reused
        assert nccl["twins"] == 1 and nccl["twins_reused"], nccl
