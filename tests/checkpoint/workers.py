"""What the 4-rank and the 2-rank gloo runs of the checkpoint tests do (one run each per test
session: starting ranks costs more on 2 cores than the work).

4 ranks: HF loading under FSDP4, HSDP 2x2, FSDP2 x SP2, FSDP4 x EP2 and SP2 x EP2; two training
steps saved under FSDP4 (Llama) and FSDP4 x EP2 (Qwen3-MoE), reloaded as FSDP2 x SP2 (x EP2).
2 ranks: HF loading under FSDP2 and EP2 (with full AC too: the experts outside FSDP); the 4-rank
checkpoints reloaded as FSDP2, EP1 and EP2 with full AC;
rank 0 exports them to HF folders, both ranks import those back to DCP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from tests.checkpoint.common import MiniTrainer, build, full_state, has_module, rank0, text_logits

FSDP = "--parallelism.data_parallel_shard_degree"
SP = "--parallelism.ulysses_degree"
EP = "--parallelism.expert_parallel_degree"
FULL_AC = ("--activation_checkpoint.mode", "full")
HAS_SP = has_module("torchtitan_omni.distributed.ulysses")
HAS_EP = has_module("torchtitan_omni.distributed.expert_parallel")
SEQ = 16
TOKENS = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(7))

#: HF loading layouts: name -> (world size, flavor, overrides, ranks holding each byte)
HF_LAYOUTS = {
    "fsdp2": (2, "llama", (FSDP, "2"), 1),
    "ep2": (2, "moe", (FSDP, "2", EP, "2"), 1),
    # every block checkpointed: the experts skip FSDP (EP2 over both ranks)
    "ep2_full_ac": (2, "moe", (FSDP, "2", EP, "2", *FULL_AC), 1),
    "fsdp4": (4, "llama", (FSDP, "4"), 1),
    "hsdp2x2": (4, "llama", ("--parallelism.data_parallel_replicate_degree", "2", FSDP, "2"), 2),
    "fsdp2_sp2": (4, "llama", (FSDP, "2", SP, "2"), 1),
    "fsdp4_ep2": (4, "moe", (FSDP, "4", EP, "2"), 1),
    "sp2_ep2": (4, "moe", (FSDP, "2", SP, "2", EP, "2"), 1),
}
#: checkpoint re-loads: name -> (world size, flavor, overrides)
RELOADS = {
    "llama_fsdp2_sp2": (4, "llama", (FSDP, "2", SP, "2")),
    "moe_sp2_ep2": (4, "moe", (FSDP, "2", SP, "2", EP, "2")),
    "llama_fsdp2": (2, "llama", (FSDP, "2")),
    "moe_ep1": (2, "moe", (FSDP, "2")),
    "moe_ep2_full_ac": (2, "moe", (FSDP, "2", EP, "2", *FULL_AC)),
}
COMMON = ("--checkpoint.interval", "1")


def available(overrides) -> bool:
    """Whether the parallelisms a layout needs exist in the framework."""
    return (SP not in overrides or HAS_SP) and (EP not in overrides or HAS_EP)


def _hf_layouts(world: int, hf_folders: dict) -> dict:
    from torchtitan_omni.checkpoint.weights import load_initial_weights

    out = {}
    for name, (w, flavor, overrides, _) in HF_LAYOUTS.items():
        if w != world or not available(overrides):
            continue
        model, dims, _ = build(world, "--model.flavor", flavor, *overrides)
        init = full_state(model)
        (report,) = load_initial_weights(model, [f"llm={hf_folders[flavor]}"])
        out[name] = {
            "init": rank0(init), "loaded": rank0(full_state(model)),
            "logits": text_logits(model, dims, TOKENS, SEQ), "read": report.bytes_read,
            "total": report.checkpoint_bytes, "sp": dims.sp,
            "sp_rank": dims.get_mesh("sp").get_local_rank() if dims.sp_enabled else 0,
            "experts_in_fsdp": any(isinstance(m, FSDPModule) for n, m in model.named_modules()
                                   if n.endswith(".experts")),
        }
    return out


def _train_and_save(folder: str, flavor: str, *overrides: str) -> dict:
    t = MiniTrainer(4, folder, *COMMON, "--model.flavor", flavor, *overrides)
    t.step()
    t.step()
    t.save()
    t.manager.close()
    return rank0(t.full_states())


def _reloads(world: int, folders: dict) -> dict:
    out = {}
    for name, (w, flavor, overrides) in RELOADS.items():
        if w != world or not available(overrides) or (flavor == "moe" and not HAS_EP):
            continue
        t = MiniTrainer(world, folders[flavor], *COMMON, "--model.flavor", flavor, *overrides)
        assert t.manager.load(), f"{name}: nothing loaded from {folders[flavor]}"
        out[name] = rank0(t.full_states())
        t.manager.close()
    return out


def run_four(rank, world_size, hf_folders, ckpt_folders):
    out = {"hf": _hf_layouts(4, hf_folders), "saved": {}}
    out["saved"]["llama"] = _train_and_save(ckpt_folders["llama"], "llama", FSDP, "4")
    if HAS_EP:
        out["saved"]["moe"] = _train_and_save(ckpt_folders["moe"], "moe", FSDP, "4", EP, "2")
    out["reloads"] = _reloads(4, ckpt_folders)
    return out


def run_two(rank, world_size, hf_folders, ckpt_folders, convert_root):
    import os

    from tests.checkpoint.common import CONFIG, load_convert_script

    out = {"hf": _hf_layouts(2, hf_folders), "reloads": _reloads(2, ckpt_folders)}
    convert = load_convert_script()
    flavors = [f for f in ("llama", "moe") if f == "llama" or HAS_EP]
    exported = {}
    if rank == 0:  # DCP -> HF needs no process group: one process does it
        for flavor in flavors:
            exported[flavor] = convert.dcp_to_hf(
                CONFIG, ["--model.flavor", flavor], ckpt_folders[flavor],
                os.path.join(convert_root, f"hf_{flavor}"))["llm"]
    dist.barrier()
    imported = {}
    for flavor in flavors:  # HF -> DCP on both ranks (sharded import)
        hf = os.path.join(convert_root, f"hf_{flavor}", "llm")
        imported[flavor] = convert.hf_to_dcp(
            CONFIG, ["--model.flavor", flavor, FSDP, "2"], [f"llm={hf}"],
            os.path.join(convert_root, f"dcp_{flavor}"))
    out["exported"], out["imported"] = exported, imported
    return rank0(out) if rank == 0 else {"hf": out["hf"]}
