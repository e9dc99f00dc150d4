"""Resume across per-part layouts: a checkpoint saved in the default (homogeneous) layout
continues in a heterogeneous one (``[parallelism.parts]`` tables), and the reverse.

llama_omni debugmodel with every modality (``train_configs/llama_omni_debug.toml``), float32,
through ``run_train.sh`` on 2 ranks under Ulysses SP2, in two layouts:

- ``default``: every part FSDP-sharded over both ranks;
- ``mixed`` (``MIXED_TOML`` of ``tests/distributed/test_part_layouts.py``): the vision tower
  replicated (``fsdp_mesh = "none"``), its media balanced over both ranks and checkpointed;
  audio on the ``dp_shard`` mesh (replicated over SP) and split over the SP ranks; the image
  decoder on ``dp_shard``.

So model and optimizer tensors are saved as shards of one layout and read into replicas of the
other (and back). Each layout trains 4 steps uninterrupted, saving full checkpoints (model and
optimizer) at steps 2 and 4. Each one's step-2 checkpoint then resumes in the other layout:
its losses of steps 3-4 equal the uninterrupted run *of the layout resumed into* within 1e-5
(the reference that differs from the resumed run only by the resume), and the step-4
checkpoint it writes holds that run's tensors (model and Adam moments, within 1e-5 of each
tensor's largest value; on CPU they come out bit-identical, but gloo's reductions are not
promised to stay so). The two uninterrupted runs agree within 1e-5 as
well (the claim of ``test_part_layouts.py``, through the launcher here), so the check is not
met by a resume that silently re-initializes a part: steps 3-4 would then differ.

The two uninterrupted runs (:func:`train_layouts`) are a session fixture, ``part_layout_runs``
(``tests/conftest.py``): ``test_part_layouts.py`` checks the tables' log lines and losses
through the launcher on the same two runs.
"""

from __future__ import annotations

import os

import pytest
import torch

from torch.distributed.checkpoint import FileSystemReader

from tests.checkpoint.common import copy_checkpoints, dcp_tensors, train_logged
from tests.distributed.test_part_layouts import DEBUG_TOML, MIXED_TOML

pytestmark = pytest.mark.slow
STEPS, SAVED = 4, 2
TOL = 1e-5
COMMON = ("--parallelism.ulysses_degree", "2", "--training.steps", str(STEPS),
          "--lr_scheduler.warmup_steps", str(SAVED),
          "--checkpoint.enable", "--checkpoint.interval", str(SAVED),
          "--checkpoint.no-last_save_model_only", "--checkpoint.keep_latest_k", "0",
          # 1 row: every non-empty encoder call is checkpointed where an encoder is (the mixed
          # layout's vision tower; the same losses), and the log says so (test_part_layouts)
          "--omni.encoder_checkpoint_min_tokens", "1")
#: the line ``parallelize`` logs for the mixed layout's meshes
MIXED_MESHES = "encoders.vision: none, one unit, encoders.audio: dp_shard,"
#: tensors whose saved chunks show the layout: 2 shards in the default layout, 1 replica (DCP
#: keeps one copy of equal replicas) in the mixed one
PROBES = ("encoders.vision.blocks.0.attn.qkv.weight", "encoders.audio.blocks.0.mlp.fc1.weight")
CHUNKS = {"default": 2, "mixed": 1}


def _chunks(folder: str, step: int) -> dict[str, int]:
    """How many chunks the probe tensors and their Adam moments were saved in."""
    meta = FileSystemReader(os.path.join(folder, "checkpoint", f"step-{step}")).read_metadata()
    keys = [k for p in PROBES for k in (p, f"optimizer.state.{p}.exp_avg")]
    return {k: len(meta.state_dict_metadata[k].chunks) for k in keys}


def train_layouts(tmp_path_factory) -> dict[str, dict]:
    """Per layout, ``default`` and ``mixed``, trained uninterrupted with :data:`COMMON`: its
    config file (``config``), dump folder with checkpoints at steps 2 and 4 (``folder``),
    full-precision losses (``losses``) and console output (``output``). The session fixture
    ``part_layout_runs`` (``tests/conftest.py``) calls it once for this module and
    ``test_part_layouts.py``."""
    configs = tmp_path_factory.mktemp("part_layout_configs")
    out = {}
    for name, text in (("default", DEBUG_TOML), ("mixed", DEBUG_TOML + MIXED_TOML)):
        # the bundled config's relative paths (dataset, tokenizer) are read from the repository
        config = configs / f"{name}.toml"
        config.write_text(text)
        folder = str(tmp_path_factory.mktemp(f"uninterrupted_{name}"))
        losses, output = train_logged(str(config), folder, 2, *COMMON)
        out[name] = {"config": str(config), "folder": folder, "losses": losses,
                     "output": output}
    return out


@pytest.fixture(scope="module")
def configs(part_layout_runs) -> dict[str, str]:
    return {name: run["config"] for name, run in part_layout_runs.items()}


@pytest.fixture(scope="module")
def uninterrupted(part_layout_runs) -> dict[str, tuple[str, dict]]:
    """Per layout: its dump folder (checkpoints at steps 2 and 4) and its losses."""
    out = {}
    for name, run in part_layout_runs.items():
        folder, losses, output = run["folder"], run["losses"], run["output"]
        assert sorted(losses) == list(range(1, STEPS + 1)), output[-3000:]
        assert (MIXED_MESHES in output) == (name == "mixed"), output[-3000:]
        assert sorted(os.listdir(os.path.join(folder, "checkpoint"))) == ["step-2", "step-4"]
        assert set(_chunks(folder, SAVED).values()) == {CHUNKS[name]}, _chunks(folder, SAVED)
        out[name] = folder, losses
    return out


def _close(a: dict[int, dict], b: dict[int, dict], steps) -> list[str]:
    """Where two runs' named losses differ by more than :data:`TOL`."""
    return [f"step {s} {k}: {a[s][k]!r} vs {b[s][k]!r}" for s in steps
            for k in b[s] if abs(a[s][k] - b[s][k]) > TOL]


def test_the_two_layouts_train_alike(uninterrupted):
    (_, default), (_, mixed) = uninterrupted["default"], uninterrupted["mixed"]
    assert set(default[1]) == {"text", "gen_image"}, default[1]
    assert not _close(mixed, default, range(1, STEPS + 1))


@pytest.mark.parametrize("saved_in, resumed_in", [("default", "mixed"), ("mixed", "default")])
def test_resume_in_the_other_layout_continues_its_run(configs, uninterrupted, tmp_path,
                                                      saved_in, resumed_in):
    src, _ = uninterrupted[saved_in]
    ref_folder, reference = uninterrupted[resumed_in]
    folder = str(tmp_path)
    copy_checkpoints(src, folder, drop=(STEPS,))
    losses, output = train_logged(configs[resumed_in], folder, 2, *COMMON)
    assert f"Loading the checkpoint from {folder}/checkpoint/step-{SAVED}" in output
    assert (MIXED_MESHES in output) == (resumed_in == "mixed"), output[-3000:]
    assert sorted(losses) == list(range(SAVED + 1, STEPS + 1)), output[-3000:]
    assert not _close(losses, reference, range(SAVED + 1, STEPS + 1))
    assert set(_chunks(folder, STEPS).values()) == {CHUNKS[resumed_in]}
    # the step-4 state written in the resumed layout: the reference run's
    ref = dcp_tensors(os.path.join(ref_folder, "checkpoint", f"step-{STEPS}"))
    got = dcp_tensors(os.path.join(folder, "checkpoint", f"step-{STEPS}"))
    assert ref.keys() == got.keys() and any(k.startswith("optimizer.state.") for k in ref)
    worst = {}  # relative to each tensor's largest value
    for key, r in ref.items():
        if r.is_floating_point():
            worst[key] = float((got[key] - r).abs().max()) / max(float(r.abs().max()), 1e-6)
        else:
            assert torch.equal(got[key], r), key
    assert max(worst.values()) <= TOL, sorted(worst.items(), key=lambda kv: -kv[1])[:10]
