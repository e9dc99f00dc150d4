"""Non-colocated encoders in the trainer (``[parallelism.parts."encoders.<name>"] ranks``).

- the meshes per role (``distributed/rank_sets.py``): on 4 gloo ranks with encoder ranks 0
  and 2, each rank's data-parallel meshes span its own set, a replicated part's mesh
  replicates over the set, the encoder ranks read no data, and the combined gradient norm
  counts each set once;
- every start-up refusal, one line naming the key (``config/noncolocated.py``);
- through ``run_train.sh`` (llama_omni debug, every modality, float32, deterministic, two
  micro-batches per step, validation after step 2 on two held-out batches): encoders on rank
  0 of 3 (``encoder_schedule = "sync"``) against colocated on 2 processes, every step's named
  losses and gradient norm and every validation metric within 1e-5, the encoder rank serving
  as many validation forwards as the LLM ranks ran; a colocated checkpoint resumed with the
  encoders on ranks 0-1 of 4 (two encoder ranks, FSDP among them) and the pipelined schedule
  continues the colocated and the synchronous runs within 1e-5 (validation included), its
  encoder ranks having encoded micro-batch 2 before micro-batch 1's gradients came (the
  synchronous run's after); the non-colocated run's checkpoint (the same tensor names as
  colocated) resumes colocated.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed.test_part_layouts import DEBUG_TOML, _refused
from tests.harness import REPO, run_distributed, run_train

TOL = 1e-5
STEPS = 3
NONCOLOCATED = REPO / "train_configs" / "llama_omni_debug_noncolocated.toml"
DEBUG = str(REPO / "train_configs" / "llama_omni_debug.toml")


def _ranks_toml(vision: str = "[0]", audio: str | None = "[0]") -> str:
    text = f'\n[parallelism.parts."encoders.vision"]\nranks = {vision}\n'
    if audio is not None:
        text += f'\n[parallelism.parts."encoders.audio"]\nranks = {audio}\n'
    return text


# ----------------------------------------------------------------- meshes per role
def _meshes(rank, world, encoder_ranks):
    import torch.distributed as dist

    from torchtitan_omni.distributed.noncolocated import combine_grad_norms
    from torchtitan_omni.distributed.rank_sets import rank_set_dims

    dims = rank_set_dims(world, encoder_ranks)
    out = {"on_encoders": dims.on_encoders, "dp_enabled": dims.dp_enabled,
           "degree": dims.dp_shard, "world_size": dims.world_size}
    for name in ("batch", "loss", "fsdp", "dp_shard"):
        out[name] = dims.named_mesh(name).mesh.tolist()
    summed = torch.tensor([float(rank)])
    dist.all_reduce(summed, group=dims.get_mesh("fsdp").get_group())
    out["fsdp_sum"] = float(summed)
    out["none"] = dims.part_mesh("none").mesh.tolist()
    out["sp"] = dims.get_optional_mesh("sp")
    # each set's squared norm: 4 on the encoder ranks, 9 on the LLM ranks
    square = torch.tensor(4.0 if dims.on_encoders else 9.0)
    out["combined"] = float(combine_grad_norms(square, dims.rank_sets))
    return out


def test_each_rank_set_has_its_own_meshes():
    results = run_distributed(_meshes, 4, (0, 2), timeout=300)
    sets = {True: [0, 2], False: [1, 3]}
    for rank, res in enumerate(results):
        mine = sets[rank in (0, 2)]
        assert res["on_encoders"] == (rank in (0, 2)), (rank, res)
        assert res["dp_enabled"] == (not res["on_encoders"]), (rank, res)  # no data read
        assert (res["degree"], res["world_size"]) == (2, 2), (rank, res)
        for name in ("batch", "loss", "fsdp", "dp_shard"):
            assert res[name] == mine, (rank, name, res)
        assert res["fsdp_sum"] == sum(mine), (rank, res)
        assert res["none"] == [[r] for r in mine], (rank, res)  # replicated over the set
        assert res["sp"] is None
        assert res["combined"] == 13.0, (rank, res)  # each set once


# ----------------------------------------------------------------- start-up refusals
NC = _ranks_toml()
REFUSALS = [
    (_ranks_toml("[0]", "[1]"), (),
     'parallelism.parts."encoders.audio".ranks = [1] differs from '
     'parallelism.parts."encoders.vision".ranks = [0]'),
    (_ranks_toml("[0]", None), (),
     'parallelism.parts."encoders.audio".ranks is not set while '
     'parallelism.parts."encoders.vision".ranks is'),
    (_ranks_toml("[3]", "[3]"), (),
     'parallelism.parts."encoders.vision".ranks = [3]: rank 3 is outside the 3 processes'),
    (_ranks_toml("[0, 0]", "[0, 0]"), (),
     'parallelism.parts."encoders.vision".ranks = [0, 0] names a rank twice'),
    (_ranks_toml("[0, 1, 2]", "[0, 1, 2]"), (),
     'parallelism.parts."encoders.vision".ranks = [0, 1, 2] takes every rank'),
    (_ranks_toml("[]", "[]"), (), 'parallelism.parts."encoders.vision".ranks is empty'),
    (_ranks_toml('"0"', '"0"'), (),
     'parallelism.parts."encoders.vision".ranks must be a list of rank numbers'),
    (NC + '\n[parallelism.parts."decoders.gen_image"]\nranks = [0]\n', (),
     'parallelism.parts."decoders.gen_image".ranks: only encoders run on their own ranks'),
    (NC + "\n[parallelism.parts.llm]\nranks = [0]\n", (),
     'parallelism.parts."llm".ranks: only encoders run on their own ranks'),
    (NC.replace("ranks = [0]\n", 'ranks = [0]\nsequence_parallel = "balance"\n', 1), (),
     'parallelism.parts."encoders.vision".sequence_parallel = "balance" with non-colocated'),
    (NC + '\n[omni]\nfreeze = ["encoders.vision", "encoders.audio"]\n', (),
     "omni.freeze = ['encoders.audio', 'encoders.vision'] freezes every encoder"),
    (NC, ("--parallelism.encoder_sequence_parallel", "split"),
     "parallelism.encoder_sequence_parallel: encoders split or balanced over ranks is not "
     "supported with non-colocated encoders"),
    (NC, ("--parallelism.ulysses_degree", "2"), "parallelism.ulysses_degree: Ulysses"),
    (NC, ("--parallelism.expert_parallel_degree", "2"), "parallelism.expert_parallel_degree"),
    ("", ("--parallelism.encoder_schedule", "pipelined"),
     'parallelism.encoder_schedule = "pipelined" needs non-colocated encoders'),
    (NC, ("--compile.enable",), "compile.enable: torch.compile is not supported"),
    (NC, ("--lora.enable",), "lora.enable: LoRA is not supported"),
    (NC, ("--weights.sources", "encoders.vision=/tmp"), "weights.sources: initial weights"),
    (NC, ("--model.converters", "float8"), "model.converters: model converters"),
    (NC, ("--training.enable_cpu_offload",), "training.enable_cpu_offload: CPU offload"),
    (NC, ("--omni.activation_offload",), "omni.activation_offload: activation offload"),
    (NC, ("--omni.encoder_order", "work"), "omni.encoder_order: an encoder order by work"),
    # one encoder rank: the encoders are not FSDP-sharded, one unit or not
    (NC.replace("ranks = [0]\n", 'ranks = [0]\nfsdp_unit = "part"\n', 1), (),
     'parallelism.parts."encoders.vision".fsdp_unit = "part" cannot act: the encoders run on '
     "one rank"),
]


@pytest.mark.parametrize("extra, overrides, expected", REFUSALS,
                         ids=[r[2].split(":")[0].split(" ")[0][:60] + f"-{i}"
                              for i, r in enumerate(REFUSALS)])
def test_refusals_name_the_key(tmp_path, monkeypatch, extra, overrides, expected):
    monkeypatch.setenv("NGPU", "3")
    path = tmp_path / "job.toml"
    path.write_text(DEBUG_TOML + extra)
    line = _refused(str(path), *overrides)
    assert expected in line, line


def test_hsdp_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("NGPU", "5")  # 4 LLM ranks: HSDP 2 x 2 would fit
    path = tmp_path / "job.toml"
    path.write_text(DEBUG_TOML + NC)
    line = _refused(str(path), "--parallelism.data_parallel_replicate_degree", "2")
    assert line.startswith("parallelism.data_parallel_replicate_degree: HSDP"), line


def test_degrees_are_the_llm_ranks(monkeypatch):
    from torchtitan_omni.config.manager import parse_config

    monkeypatch.setenv("NGPU", "3")
    cfg = parse_config(str(NONCOLOCATED))  # dp_shard = -1: the 2 LLM ranks
    assert cfg.parallelism.parts["encoders.vision"]["ranks"] == [0]
    monkeypatch.setenv("NGPU", "4")
    assert parse_config(str(NONCOLOCATED), ["--parallelism.data_parallel_shard_degree", "3"])


# ----------------------------------------------------------------- through run_train.sh
CHECKPOINTS = ("--checkpoint.enable", "--checkpoint.interval", "1",
               "--checkpoint.no-last_save_model_only", "--checkpoint.keep_latest_k", "0")
# two micro-batches of one row per step on each of the 2 data (LLM) ranks
ACCUMULATION = ("--training.local_batch_size", "1", "--training.global_batch_size", "4")
VALIDATION = ("--validation.enable", "--validation.freq", "2", "--validation.steps", "2",
              "--validation.seq_len", "256", "--validation.local_batch_size", "2")
COMMON = ("--training.steps", str(STEPS), "--lr_scheduler.warmup_steps", "1",
          "--debug.deterministic", "--debug.seed", "42", *CHECKPOINTS, *ACCUMULATION,
          *VALIDATION)
PIPELINED = ("--parallelism.encoder_schedule", "pipelined")
#: the encoder server's order within a step of two micro-batches
SYNC_ORDER = ["encode 0", "gradients 0", "encode 1", "gradients 1"]
PIPELINED_ORDER = ["encode 0", "encode 1", "gradients 0", "gradients 1"]


def _train(config, folder: str, ngpu: int, *overrides: str,
           common: tuple[str, ...] = COMMON) -> dict[str, dict]:
    """Every step's named losses and gradient norm at full precision (global rank 0), and the
    balanced encoders' imbalance (``balance``), ``steps``; the encoder server's order per step
    (an encoder rank 0), ``events``; every validation's metrics, ``validation``; what
    ``run_train`` returned (the console's losses and output), ``run``. ``common``: the
    arguments before ``overrides`` (this module's settings by default)."""
    import json

    files = {name: os.path.join(folder, f"{name}.jsonl") for name in ("steps", "validation")}
    run = run_train(config, ngpu, "--job.dump_folder", folder, *common, *overrides,
                    env={"TRAIN_FILE": "tests.distributed.noncolocated_entry",
                         "OMNI_STEP_FILE": files["steps"],
                         "OMNI_VALIDATION_FILE": files["validation"]})
    assert run.returncode == 0, run.output[-4000:]
    out: dict[str, dict] = {"events": {}}
    for name, path in files.items():
        records = []
        if os.path.exists(path):  # no validation file without a validation step
            with open(path) as f:
                records = [json.loads(line) for line in f]
        out[name] = {r.pop("step"): r for r in records}
    for step, record in out["steps"].items():
        out["events"][step] = record.pop("events", None)
    out["run"] = run
    return out


def _resumed(src: str, dst: str, keep: int) -> None:
    """``src``'s checkpoints up to step ``keep`` in ``dst``: a run there resumes from it."""
    import shutil

    for step in range(1, keep + 1):
        shutil.copytree(os.path.join(src, "checkpoint", f"step-{step}"),
                        os.path.join(dst, "checkpoint", f"step-{step}"))


def _close(got: dict, ref: dict, steps) -> list[str]:
    problems = []
    for step in steps:
        for key, value in ref[step].items():
            if key == "served":
                continue
            err = abs(got[step][key] - value) / max(abs(value), 1e-12)
            if err > TOL:
                problems.append(f"step {step} {key}: {got[step][key]!r} vs {value!r}")
    return problems


def _keys(folder: str, step: int) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(os.path.join(folder, "checkpoint", f"step-{step}")).read_metadata()
    return {k for k in meta.state_dict_metadata if not k.startswith("rng.")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[str, dict]]:
    """colocated (2 processes), non-colocated synchronous (rank 0 of 3), each 3 steps with a
    checkpoint per step; then the colocated step-1 checkpoint resumed on ranks 0-1 of 4 with
    the pipelined schedule, and the non-colocated step-2 one resumed colocated."""
    colocated = str(tmp_path_factory.mktemp("colocated"))
    out = {"colocated": (colocated, _train(DEBUG, colocated, 2))}
    folder = str(tmp_path_factory.mktemp("noncolocated"))
    out["noncolocated"] = (folder, _train(NONCOLOCATED, folder, 3))
    two = tmp_path_factory.mktemp("pipelined")
    (two / "job.toml").write_text(DEBUG_TOML + _ranks_toml("[0, 1]", "[0, 1]"))
    _resumed(out["colocated"][0], str(two), keep=1)
    out["pipelined"] = (str(two), _train(two / "job.toml", str(two), 4, *PIPELINED))
    back = str(tmp_path_factory.mktemp("back_to_colocated"))
    _resumed(out["noncolocated"][0], back, keep=2)
    out["back"] = (back, _train(DEBUG, back, 2))
    return out


def _check_validation(got: dict, ref: dict) -> None:
    assert sorted(got) == sorted(ref) == [2], (got, ref)
    assert set(got[2]) == set(ref[2]), (sorted(got[2]), sorted(ref[2]))
    assert {"validation/loss/text", "validation/loss/gen_image"} <= set(ref[2]), ref
    assert any(k.startswith("validation/mix/") and k != "validation/mix/text_only"
               for k in ref[2]), ref  # the encoders' rows count
    assert not _close(got, ref, [2])
    # the encoder rank served the LLM ranks' forwards, no more, no fewer
    assert got[2]["served"] == got[2]["validation/batches"] == 2, got


@pytest.mark.slow
def test_rank_0_of_3_matches_colocated(runs):
    colocated, noncolocated = runs["colocated"][1], runs["noncolocated"][1]
    steps = noncolocated["steps"]
    assert sorted(steps) == list(range(1, STEPS + 1)), steps
    assert set(steps[1]) == {"grad_norm", "text", "gen_image"}
    assert not _close(steps, colocated["steps"], range(1, STEPS + 1))
    _check_validation(noncolocated["validation"], colocated["validation"])
    # synchronous: micro-batch 1's gradients came back before micro-batch 2 was encoded
    assert all(e == SYNC_ORDER for e in noncolocated["events"].values()), noncolocated["events"]
    # the same tensor names (model, optimizer, data loader, schedulers) as colocated
    assert _keys(runs["noncolocated"][0], 2) == _keys(runs["colocated"][0], 2)


@pytest.mark.slow
def test_pipelined_on_two_encoder_ranks_resumes_colocated(runs):
    resumed = runs["pipelined"][1]
    steps = resumed["steps"]
    assert sorted(steps) == [2, 3], steps  # from step 1
    # pipelined: micro-batch 2 encoded before micro-batch 1's gradients came
    assert all(e == PIPELINED_ORDER for e in resumed["events"].values()), resumed["events"]
    assert not _close(steps, runs["colocated"][1]["steps"], (2, 3))
    assert not _close(steps, runs["noncolocated"][1]["steps"], (2, 3))
    _check_validation(resumed["validation"], runs["colocated"][1]["validation"])


@pytest.mark.slow
def test_noncolocated_checkpoint_resumes_colocated(runs):
    resumed = runs["back"][1]["steps"]
    assert sorted(resumed) == [3], resumed  # from step 2
    assert not _close(resumed, runs["colocated"][1]["steps"], (3,))
