"""Per-part layouts (``[parallelism.parts."<part>"]``, ``torchtitan_omni.config.parts``): the
TOML interface and its one-line refusals, and the llama_omni debug model with every modality
under a mixed layout (vision replicated, balanced over all ranks and checkpointed; audio on
the dp_shard mesh and split over the SP ranks; the image decoder on dp_shard), whose losses and
gradients equal the default layout's and the single-process reference's in float32; the
qwen3_moe_omni debug model (MoE foundation, no image decoder) likewise under Ulysses 2 x expert
parallel 2 with the encoders' tables."""

from __future__ import annotations

import re

import pytest
import torch

from tests.distributed import common as C
from tests.harness import REPO, run_distributed
from torchtitan_omni.config.manager import ConfigError, parse_config
from torchtitan_omni.distributed.part_layouts import part_mesh_choice, part_settings
from torchtitan_omni.distributed.checks import fsdp_unit_problem, parts_problem
from torchtitan_omni.protocols.modules import OmniEncoder
from torchtitan_omni.protocols.plan import OmniParallelPlan, PartLayout

RTOL = 1e-5
DEBUG_TOML = (REPO / "train_configs" / "llama_omni_debug.toml").read_text()

MIXED = {
    "encoders.vision": {"fsdp_mesh": "none", "sequence_parallel": "balance",
                        "activation_checkpoint": "full"},
    "encoders.audio": {"fsdp_mesh": "dp_shard", "fsdp_unit": "block",
                       "sequence_parallel": "split"},
    "decoders.gen_image": {"fsdp_mesh": "dp_shard"},
}
MIXED_TOML = """
[parallelism.parts."encoders.vision"]
fsdp_mesh = "none"
sequence_parallel = "balance"
activation_checkpoint = "full"

[parallelism.parts."encoders.audio"]
fsdp_mesh = "dp_shard"
fsdp_unit = "block"
sequence_parallel = "split"

[parallelism.parts."decoders.gen_image"]
fsdp_mesh = "dp_shard"
"""


def _toml(tmp_path, extra: str, parallelism: str = "") -> str:
    text = DEBUG_TOML.replace("[parallelism]\n", f"[parallelism]\n{parallelism}")
    path = tmp_path / "job.toml"
    path.write_text(text + extra)
    return str(path)


def _refused(path: str, *overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(path, list(overrides))
    assert "\n" not in str(e.value)
    return str(e.value)


# ----------------------------------------------------------------- the TOML interface
def test_tables_override_the_global_keys_key_by_key(tmp_path, monkeypatch):
    monkeypatch.setenv("NGPU", "2")
    path = _toml(tmp_path, MIXED_TOML, 'encoder_fsdp_mesh = "fsdp"\n'
                 'encoder_sequence_parallel = "split"\n')
    cfg = parse_config(path)
    assert cfg.parallelism.parts == MIXED
    vision = part_settings(cfg, "encoders.vision")
    assert (vision.fsdp_mesh, vision.sequence_parallel, vision.activation_checkpoint) == (
        "none", "balance", "full")
    audio = part_settings(cfg, "encoders.audio")  # activation_checkpoint: the global's
    assert (audio.fsdp_mesh, audio.fsdp_unit, audio.sequence_parallel,
            audio.activation_checkpoint) == ("dp_shard", "block", "split", "none")
    assert audio.own == {"fsdp_mesh", "fsdp_unit", "sequence_parallel"}
    assert part_settings(cfg, "encoders.vision").fsdp_unit == "part"  # the global's
    # the decoder's frozen VQ (a plan part of its own) inherits the decoder's table, not as
    # its own key
    vq = part_settings(cfg, "decoders.gen_image.vq")
    assert vq.fsdp_mesh == "dp_shard" and not vq.own
    # no table: the global keys
    cfg.parallelism.parts = {}
    assert part_settings(cfg, "encoders.vision").fsdp_mesh == "fsdp"
    # a key the TOML sets can be changed on the command line (and is checked again)
    cfg = parse_config(path, ["--parallelism.parts.encoders.vision.fsdp-mesh", "dp_shard"])
    assert cfg.parallelism.parts["encoders.vision"]["fsdp_mesh"] == "dp_shard"
    assert "got 'shard'" in _refused(path, "--parallelism.parts.encoders.vision.fsdp_mesh",
                                     "shard")


def test_frozen_parts_keep_the_plan_mesh_unless_their_own_table_says_otherwise():
    cfg = C.job_config(parallelism__encoder_fsdp_mesh="fsdp")
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    trained = torch.nn.Linear(2, 2)
    vq, dec = PartLayout("decoders.gen_image.vq", mesh="none"), PartLayout("decoders.gen_image")
    assert part_mesh_choice(vq, frozen, cfg) == "none"  # the global key
    assert part_mesh_choice(dec, trained, cfg) == "fsdp"
    cfg.parallelism.parts = {"decoders.gen_image": {"fsdp_mesh": "dp_shard"}}
    assert part_mesh_choice(vq, frozen, cfg) == "none"  # the decoder's table
    assert part_mesh_choice(dec, trained, cfg) == "dp_shard"
    cfg.parallelism.parts = {"encoders.audio": {"fsdp_mesh": "none"}}
    audio = PartLayout("encoders.audio")
    assert part_mesh_choice(audio, frozen, cfg) == "none"  # its own table: honoured
    cfg.parallelism.parts = {"encoders.audio": {"fsdp_mesh": "plan"}}
    assert part_mesh_choice(audio, trained, cfg) == "fsdp"  # the plan's, over the global
    assert part_mesh_choice(PartLayout("llm"), trained, cfg) == "fsdp"


@pytest.mark.parametrize("extra, expected", [
    ('[parallelism.parts."encoders.visoin"]\nfsdp_mesh = "none"\n',
     "parallelism.parts.\"encoders.visoin\": LlamaOmniModel has no part 'encoders.visoin' "
     "(its encoders and decoders: encoders.vision, encoders.audio, decoders.gen_image) "
     "(did you mean 'encoders.vision'?)"),
    ('[parallelism.parts.llm]\nfsdp_mesh = "none"\n',
     'parallelism.parts."llm": the foundation is laid out by [activation_checkpoint]'),
    ('[parallelism.parts."encoders.vision"]\nfsdp_mash = "none"\n',
     'unknown key parallelism.parts."encoders.vision".fsdp_mash (keys: fsdp_mesh, fsdp_unit, '
     "sequence_parallel, activation_checkpoint, ranks) (did you mean 'fsdp_mesh'?) in "),
    ('[parallelism.parts."encoders.vision"]\nfsdp_unit = "encoder"\n',
     'parallelism.parts."encoders.vision".fsdp_unit must be one of \'block\', \'part\', '
     "got 'encoder'"),
    ('[parallelism.parts."decoders.gen_image"]\nfsdp_unit = "part"\n',
     'parallelism.parts."decoders.gen_image".fsdp_unit: decoders take no fsdp_unit (a '
     "decoder is called through its heads, not its forward, so its blocks stay units of their "
     "own); set it on encoders"),
    ('[parallelism.parts."encoders.vision"]\nfsdp_mesh = "shard"\n',
     'parallelism.parts."encoders.vision".fsdp_mesh must be one of \'plan\', \'fsdp\', '
     "'dp_shard', 'none', got 'shard'"),
    ('[parallelism.parts."encoders.audio"]\nactivation_checkpoint = true\n',
     'parallelism.parts."encoders.audio".activation_checkpoint must be one of \'none\', '
     "'full', 'op', 'attention', got True"),
    ('[parallelism.parts."encoders.vision"]\nranks = [0]\n',  # tests/distributed/
     'parallelism.parts."encoders.audio".ranks is not set while '  # test_noncolocated_trainer
     'parallelism.parts."encoders.vision".ranks is'),
    ('[parallelism.parts."encoders.vision"]\nsequence_parallel = "scatter"\n',
     "must be one of 'replicate', 'split', 'balance', got 'scatter'"),
    ('[parallelism.parts]\n"encoders.vision" = "none"\n',
     'parallelism.parts."encoders.vision" must be a table'),
    ('[parallelism.parts."encoders.vision".blocks]\nfsdp_mesh = "none"\n',
     'unknown key parallelism.parts."encoders.vision".blocks'),
    ('[parallelism.parts."decoders.gen_image"]\nsequence_parallel = "split"\n',
     'parallelism.parts."decoders.gen_image".sequence_parallel: decoders take no '
     "sequence_parallel"),
    ('[parallelism.parts."decoders.gen_image"]\nactivation_checkpoint = "full"\n',
     'parallelism.parts."decoders.gen_image".activation_checkpoint = "full" cannot act: the '
     "parallel plan of decoders.gen_image lists no activation-checkpoint units"),
])
def test_refusals_name_the_toml_key(tmp_path, monkeypatch, extra, expected):
    monkeypatch.setenv("NGPU", "2")
    assert expected in _refused(_toml(tmp_path, extra))


def test_parts_must_be_a_table(tmp_path):
    line = _refused(_toml(tmp_path, "", "parts = 3\n"))
    assert line.startswith("parallelism.parts must be a table of per-part tables")


def test_command_line_tables_are_refused(tmp_path):
    for args in (["--parallelism.parts.encoders.audio.sequence_parallel", "split"],
                 ["--parallelism.parts", "encoders.audio", "fsdp_mesh", "none"],
                 ["--parallelism.parts.encoders.vision.fsdp_mesh=none"]):
        line = _refused(_toml(tmp_path, '[parallelism.parts."encoders.audio"]\n'
                                        'fsdp_mesh = "none"\n'), *args)
        assert line.startswith(f"--{args[0].split('=')[0][2:]}: parallelism.parts tables are "
                               "set in the TOML config"), line
    # a program's config is checked too (not only what the parser read)
    from torchtitan_omni.config.validate import validate_job_config

    cfg = C.job_config(parallelism__parts={"encoders.image": {"fsdp_mesh": "x"}})
    with pytest.raises(ConfigError, match="fsdp_mesh must be one of"):
        validate_job_config(cfg, world_size=1)


class _NoRowsAudio(C.TinyAudioEncoder):
    output_rows = OmniEncoder.output_rows


def _meta_model(plan: OmniParallelPlan | None = None):
    with torch.device("meta"):
        model = C.build_model(C.ModelSpec())
        if plan is not None:
            model.parallel_plan = plan
        return model


def test_balance_needs_output_rows_from_either_key():
    with torch.device("meta"):
        model = _meta_model()
        model.encoders["audio"] = _NoRowsAudio(C.DIM)
    cfg = C.job_config(parallelism__parts={"encoders.audio": {"sequence_parallel": "balance"}})
    assert parts_problem(model, cfg, 2) == (
        'parallelism.parts."encoders.audio".sequence_parallel = "balance" needs encoders with '
        "output_rows; encoders.audio (_NoRowsAudio) has none")
    assert parts_problem(model, cfg, 1) is None  # one rank: nothing to balance, not installed
    cfg = C.job_config(parallelism__encoder_sequence_parallel="balance")
    assert parts_problem(model, cfg, 2).startswith(
        'parallelism.encoder_sequence_parallel = "balance" needs encoders with output_rows; '
        "encoders.audio")
    cfg.parallelism.parts = {"encoders.audio": {"sequence_parallel": "split"}}
    assert parts_problem(model, cfg, 2) is None  # its own table wins


def test_a_mesh_for_a_part_outside_the_plan_cannot_act():
    model = _meta_model(OmniParallelPlan(parts=(PartLayout("encoders.vision"),)))
    cfg = C.job_config(parallelism__parts={"encoders.audio": {"fsdp_mesh": "none"}})
    assert parts_problem(model, cfg, 2) == (
        'parallelism.parts."encoders.audio".fsdp_mesh cannot act: OmniModel\'s parallel plan '
        "has no layout for encoders.audio")
    cfg.parallelism.parts = {"encoders.audio": {"sequence_parallel": "split"}}
    assert parts_problem(model, cfg, 2) is None  # SP modes need no plan part


def test_one_unit_encoders_are_refused_where_they_cannot_act():
    blocks = PartLayout("encoders.audio", fsdp_units=("blocks.*",))
    model = _meta_model(OmniParallelPlan(parts=(PartLayout("encoders.vision"), blocks)))
    # the global key is a default for the encoders it can act on, either value, any ranks
    for unit in ("part", "block"):
        cfg = C.job_config(parallelism__encoder_fsdp_unit=unit)
        assert fsdp_unit_problem(model, cfg, 2) is None
        assert fsdp_unit_problem(model, cfg, 1) is None
    cfg = C.job_config(parallelism__parts={"encoders.vision": {"fsdp_unit": "part"}})
    assert fsdp_unit_problem(model, cfg, 2) == (
        'parallelism.parts."encoders.vision".fsdp_unit = "part" cannot act: the parallel plan '
        "of encoders.vision lists no FSDP blocks (it is one unit already)")
    cfg.parallelism.parts = {"encoders.audio": {"fsdp_unit": "part"}}
    assert fsdp_unit_problem(model, cfg, 2) is None  # the audio blocks become one unit
    assert fsdp_unit_problem(model, cfg, 1) == (
        'parallelism.parts."encoders.audio".fsdp_unit = "part" cannot act: the encoders run '
        "on one rank, nothing is FSDP-sharded")
    cfg.parallelism.parts = {"encoders.audio": {"fsdp_unit": "block"}}
    assert fsdp_unit_problem(model, cfg, 1) is None  # "block" asks for nothing to merge


# ----------------------------------------------------------------- llama_omni parity
def _mixed_extra(model, ref, dims, cfg, grads, batches):
    """What was installed on each part, and the gradients (for the default-layout check)."""
    from torchtitan_omni.distributed.activation_checkpoint import is_checkpointed
    from torchtitan_omni.distributed.boundary import BalancedMediaEncoder
    from torchtitan_omni.distributed.encoder_sp import SplitMediaEncoder

    def mesh(prefix):
        p = next(p for n, p in model.named_parameters() if n.startswith(prefix))
        return p.device_mesh.mesh_dim_names

    ref_grads = {part: sum(float(p.grad.abs().sum()) for n, p in ref.named_parameters()
                           if n.startswith(part + ".") and p.grad is not None)
                 for part in MIXED}
    return {"grads": grads, "ref_grads": ref_grads,
            "balance_stats": model.encoders["vision"]._omni_balance_stats,
            "vision": (isinstance(model.encoders["vision"], BalancedMediaEncoder),
                       all(is_checkpointed(b) for b in model.encoders["vision"].blocks),
                       mesh("encoders.vision.")),
            "audio": (isinstance(model.encoders["audio"], SplitMediaEncoder),
                      isinstance(model.encoders["audio"], BalancedMediaEncoder),
                      any(is_checkpointed(b) for b in model.encoders["audio"].blocks),
                      mesh("encoders.audio.")),
            "audio_units": _fsdp_units(model.encoders["audio"]),
            "audio_blocks": len(model.encoders["audio"].blocks),
            "decoder": (mesh("decoders.gen_image.head."), mesh("decoders.gen_image.vq."))}


def _fsdp_units(module) -> int:
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for m in module.modules())


def _grads_extra(model, ref, dims, cfg, grads, batches):
    return {"grads": grads, "audio_units": _fsdp_units(model.encoders["audio"])}


def _default_vs_mixed(world, spec, name, dims_kw) -> dict:
    """One layout's degrees, default layout then :data:`MIXED`: each against the reference,
    and the mixed one's losses and gradients against the default's."""
    from tests.distributed.test_parity import _checked, _layout_check
    from tests.models.batches import mixed_batch
    from torchtitan.protocols.train_spec import get_train_spec

    vocab = get_train_spec(spec.zoo).model_args["debugmodel"].llm_args.vocab_size
    sp = dims_kw.get("sp", 1)

    def batches(ndp):
        ref = C.reference_model(spec)  # mixed_batch asks the encoders for their rows
        return [mixed_batch(ref, vocab, seed=10 + i, multiple=sp) for i in range(ndp)]

    runs = {}
    _checked(runs, "default", lambda: _layout_check(
        world, name, spec, dims_kw, {}, batches, extra=_grads_extra))
    _checked(runs, "mixed", lambda: _layout_check(
        world, name, spec, dims_kw, dict(parallelism__parts=MIXED), batches,
        extra=_mixed_extra))
    out, base = runs["mixed"], runs["default"]
    if "error" in base:
        return {"error": base["error"]}
    if "error" not in out:
        out["default_audio_units"] = base["audio_units"]
        out["default_loss_err"] = max(C.rel_error(out["losses"][k], base["losses"][k])
                                      for k in base["losses"])
        out["default_grad_problems"] = C.compare(out.pop("grads"), base["grads"], RTOL)
        out["default_ref_loss_err"] = base["loss_err"]
        out["default_ref_grad_problems"] = base["grad_problems"]
    return out


def _llama_omni_layouts(rank, world, layouts):
    spec = C.ModelSpec(zoo="llama_omni")
    return {name: _default_vs_mixed(world, spec, name, dims_kw) for name, dims_kw in layouts}


def _assert_mixed_parity(results, name, sp: bool):
    for rank, res in enumerate(results):
        out = res[name]
        assert "error" not in out, f"rank {rank}: {out.get('error')}"
        # against the default (homogeneous) layout
        assert out["default_loss_err"] < RTOL, (rank, out["losses"])
        assert not out["default_grad_problems"], (rank, out["default_grad_problems"][:5])
        # both against one process
        assert out["loss_err"] < RTOL and out["default_ref_loss_err"] < RTOL, (rank, out)
        assert not out["grad_problems"], (rank, out["grad_problems"][:5])
        assert not out["default_ref_grad_problems"], (rank, out["default_ref_grad_problems"][:5])
        assert set(out["losses"]) == {"text", "gen_image"}, out["losses"]
        # every part of the table learns something (a check that cannot fail is no check)
        assert all(v > 0 for v in out["ref_grads"].values()), out["ref_grads"]
        assert out["balance_stats"] is not None
        assert out["vision"] == (True, True, ("replicate_all", "no_shard")), out["vision"]
        split, balanced, checkpointed, audio_mesh = out["audio"]
        assert split == sp and not balanced and not checkpointed, out["audio"]
        # fsdp_unit "block": each block, the projector and the encoder
        assert out["audio_units"] == out["audio_blocks"] + 2, out["audio_units"]
        # the default ("part"): the audio encoder is one FSDP unit, not one per block
        assert out["default_audio_units"] == 1, out["default_audio_units"]
        # dp_shard: over the data ranks only, replicated over SP ("fsdp" without SP)
        dp_shard = ("replicate_dp_sp", "dp_shard_only") if sp else ("fsdp",)
        assert audio_mesh == dp_shard, out["audio"]
        # the decoder's table moves the decoder, not its frozen VQ (the plan's "none")
        assert out["decoder"] == (dp_shard, ("replicate_all", "no_shard")), out["decoder"]


@pytest.fixture(scope="module")
def two_rank():
    layouts = [("sp2", dict(dp_shard=1, sp=2)), ("dp2", dict(dp_shard=2))]
    return run_distributed(_llama_omni_layouts, 2, layouts, timeout=900)


def test_llama_omni_mixed_layout_under_ulysses_2(two_rank):
    _assert_mixed_parity(two_rank, "sp2", sp=True)


def test_llama_omni_mixed_layout_over_two_data_ranks(two_rank):
    _assert_mixed_parity(two_rank, "dp2", sp=False)


def test_llama_omni_mixed_layout_dp2_sp2():
    results = run_distributed(_llama_omni_layouts, 4, [("dp2_sp2", dict(dp_shard=2, sp=2))],
                              timeout=900)
    _assert_mixed_parity(results, "dp2_sp2", sp=True)


MOE_MIXED = {k: v for k, v in MIXED.items() if k.startswith("encoders.")}


def _qwen3_moe_omni_mixed(rank, world):
    """qwen3_moe_omni (no image decoder) under Ulysses 2 x expert parallel 2: the default
    layout, then :data:`MOE_MIXED`, each against one process, the mixed one's losses and
    gradients against the default's."""
    from tests.distributed.test_parity import _layout_check
    from tests.models.batches import mixed_batch
    from torchtitan.protocols.train_spec import get_train_spec

    spec = C.ModelSpec(zoo="qwen3_moe_omni")
    vocab = get_train_spec(spec.zoo).model_args["debugmodel"].llm_args.vocab_size

    def batches(ndp):
        ref = C.reference_model(spec)
        return [mixed_batch(ref, vocab, seed=30 + i, multiple=2) for i in range(ndp)]

    dims_kw = dict(dp_shard=1, sp=2, ep=2)
    def extra(model, ref, dims, cfg, grads, batches):
        # every part of the table learns something (a check that cannot fail is no check)
        ref_grads = {part: sum(float(p.grad.abs().sum()) for n, p in ref.named_parameters()
                               if n.startswith(part + ".") and p.grad is not None)
                     for part in MOE_MIXED}
        from torchtitan_omni.distributed.boundary import BalancedMediaEncoder
        from torchtitan_omni.distributed.encoder_sp import SplitMediaEncoder

        installed = (isinstance(model.encoders["vision"], BalancedMediaEncoder),
                     isinstance(model.encoders["audio"], SplitMediaEncoder))
        return {"grads": grads, "ref_grads": ref_grads, "installed": installed}

    base = _layout_check(world, "sp2_ep2", spec, dims_kw, {}, batches, extra=extra)
    mixed = _layout_check(world, "sp2_ep2", spec, dims_kw, dict(parallelism__parts=MOE_MIXED),
                          batches, extra=extra)
    return {"loss_err": (base["loss_err"], mixed["loss_err"]),
            "ref_grad_problems": base["grad_problems"] + mixed["grad_problems"],
            "default_loss_err": max(C.rel_error(mixed["losses"][k], base["losses"][k])
                                    for k in base["losses"]),
            "default_grad_problems": C.compare(mixed["grads"], base["grads"], RTOL),
            "losses": sorted(mixed["losses"]), "ref_grads": mixed["ref_grads"],
            "installed": (base["installed"], mixed["installed"])}


def test_qwen3_moe_omni_mixed_layout_under_ulysses_2_and_expert_parallel_2():
    results = run_distributed(_qwen3_moe_omni_mixed, 2, timeout=900)
    for rank, out in enumerate(results):
        assert max(out["loss_err"]) < RTOL, (rank, out["loss_err"])
        assert not out["ref_grad_problems"], (rank, out["ref_grad_problems"][:5])
        assert out["default_loss_err"] < RTOL, (rank, out["default_loss_err"])
        assert not out["default_grad_problems"], (rank, out["default_grad_problems"][:5])
        assert "text" in out["losses"], out["losses"]
        assert all(v > 0 for v in out["ref_grads"].values()), out["ref_grads"]
        # default: both encoders replicated over SP; the table: vision balanced, audio split
        assert out["installed"] == ((False, False), (True, True)), out["installed"]


# ----------------------------------------------------------------- run_train.sh
#: the steps of the shared runs (``part_layout_runs``)
STEPS = 4


@pytest.mark.slow
def test_run_train_with_part_tables_matches_default(part_layout_runs):
    """The TOML tables through the launcher (config check, trainer, parallelize): Ulysses 2,
    the same per-step losses as the default layout. The two runs (4 steps, checkpoints at 2
    and 4, ``--omni.encoder_checkpoint_min_tokens 1``) are the session fixture the resume tests
    of ``tests/checkpoint/test_resume_part_layouts.py`` share."""
    from tests.harness import TrainRun, parse_losses

    # the console's losses, as run_train parses them (5 decimals)
    runs = {name: TrainRun(0, run["output"], *parse_losses(run["output"]))
            for name, run in part_layout_runs.items()}
    for run in runs.values():
        assert sorted(run.losses) == list(range(1, STEPS + 1)), run.output[-3000:]
    out = runs["mixed"].output
    assert "Encoders split media items over SP ranks: audio" in out
    assert "Encoders balance media items over 2 ranks: vision" in out
    assert "encoders.vision: none, one unit, encoders.audio: dp_shard," in out
    assert ("Activation checkpointing: encoders.vision: 2 units (encoder and decoder calls of "
            "under 1 rows run unchecked)") in out, out[-3000:]
    assert "has nothing to exempt" not in out
    assert ("omni.encoder_checkpoint_min_tokens = 1 has nothing to exempt: no encoder or "
            "decoder is activation-checkpointed") in runs["default"].output
    # the default: each encoder one FSDP unit
    assert "encoders.vision: fsdp, one unit, encoders.audio: fsdp, one unit" in (
        runs["default"].output)
    whole = re.search(r"Encoders gathered whole while they run .*: encoders.vision: "
                      r"([\d.]+)M parameters, encoders.audio: ([\d.]+)M parameters",
                      runs["default"].output)
    assert whole and all(float(n) > 0 for n in whole.groups()), runs["default"].output[-3000:]
    # the mixed layout gathers the vision tower whole, the audio encoder block by block
    assert re.search(r"gathered whole .*: encoders.vision: [\d.]+M parameters\n", out), out[-3000:]
    for step in range(1, STEPS + 1):
        base, mix = runs["default"], runs["mixed"]
        assert abs(mix.losses[step] - base.losses[step]) <= 1e-5, (base.losses, mix.losses)
        for name, value in base.named[step].items():
            assert abs(mix.named[step][name] - value) <= 1e-5, (base.named, mix.named)
