"""The omni validator on 2 gloo ranks against a single-process reference.

The reference runs every held-out batch of every data rank through an unsharded copy of the
same model and divides each summed loss by its total target count; its per-mix text losses
come from separate forwards whose labels keep only that mix's documents (another path than
the validator's per-group head calls). Layouts: FSDP2 with data ranks holding different
modalities and different numbers of batches (``steps = -1``: the rank that is through the
split forwards padding while the other goes on), and Ulysses SP2 with ``steps = 2`` out of 3
batches (the documents and media cross the slice boundary), and expert parallel 2 with
uneven ranks (a MoE foundation: its auxiliary loss is logged too).
"""

from __future__ import annotations

import contextlib
import traceback

import pytest
import torch

from tests.harness import run_distributed

RTOL = 1e-5


class ListLoader:
    """Held-out batches that, like the omni loader without workers, continue where the last
    iteration stopped unless rewound with ``load_state_dict``."""

    def __init__(self, batches) -> None:
        self.batches, self.pos = batches, 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]

    def __iter__(self):
        while self.pos < len(self.batches):
            self.pos += 1
            yield self.batches[self.pos - 1]


class Recorder:
    """The metrics processor's surface the validator uses (TensorBoard/W&B logger, clock)."""

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []
        self.time_last_log = 0.0
        self.logger = self

    def log(self, metrics: dict, step: int) -> None:
        self.logged.append((step, dict(metrics)))


def reference(model, batches) -> dict[str, float]:
    """Held-out losses of ``batches`` in one process: per loss, and per mix by masked labels."""
    from tests.distributed import common as C
    from torchtitan_omni.eval.mix import document_mix, mix_name
    from torchtitan_omni.protocols import batch as B

    sums, counts, mix_sums, mix_counts = {}, {}, {}, {}
    with torch.no_grad():
        for batch, labels in batches:
            meta, media = C._meta(batch)
            out = model(batch[B.INPUT], meta, labels, **media)
            for name, n in model.count_targets(batch, labels).items():
                counts[name] = counts.get(name, 0) + int(n)
                sums[name] = sums.get(name, 0.0) + float(out.losses[name])
            mix = document_mix(batch, labels, model.modalities)
            for g in mix[labels != B.IGNORE_INDEX].unique().tolist():
                only = labels.masked_fill(mix != g, B.IGNORE_INDEX)
                name = mix_name(g, model.modalities)
                part = model(batch[B.INPUT], meta, only, **media).losses["text"]
                mix_sums[name] = mix_sums.get(name, 0.0) + float(part)
                mix_counts[name] = mix_counts.get(name, 0) + int((only != B.IGNORE_INDEX).sum())
    out = {f"validation/loss/{n}": sums[n] / counts[n] for n in sums if counts[n]}
    out.update({f"validation/mix/{n}": mix_sums[n] / mix_counts[n] for n in mix_sums})
    return out


def _layout(world, dims_kw, steps, batches_of_rank, spec_kw=None):
    from tests.distributed import common as C
    from torchtitan_omni.components.loss import OmniLoss
    from torchtitan_omni.eval.validator import OmniValidator

    spec = C.ModelSpec(**(spec_kw or {}))
    dims = C.make_dims(world, **dims_kw)
    cfg = C.job_config(validation__enable=True, validation__steps=steps, validation__freq=3)
    model = C.parallel_model(spec, dims, cfg)
    dp = dims.get_mesh("batch").get_local_rank() if dims.dp_enabled else 0
    ndp = dims.dp_replicate * dims.dp_shard
    per_rank = [batches_of_rank(r) for r in range(ndp)]
    recorder = Recorder()
    validator = OmniValidator(cfg, ListLoader(per_rank[dp]), OmniLoss(), dims,
                              contextlib.nullcontext, contextlib.nullcontext(), recorder)
    first = validator.validate([model], 3)
    second = validator.validate([model], 6)
    used = [b for r in per_rank for b in (r if steps == -1 else r[:steps])]
    ref = reference(C.reference_model(spec), used)
    return {"first": first, "second": second, "ref": ref, "logged": recorder.logged,
            "train_mode": model.training,
            "should": [validator.should_validate(s) for s in range(1, 8)]}


def _checked(results, name, fn):
    try:
        results[name] = fn()
    except Exception:  # noqa: BLE001  (every rank raises alike, so the collectives stay matched)
        results[name] = {"error": traceback.format_exc()}


def _two_ranks(rank, world):
    from tests.distributed import common as C

    results = {}
    # FSDP2: data rank 0 holds three image-only batches, data rank 1 one audio-only batch.
    uneven = {0: [C.make_batch(300 + i, image=True, audio=False) for i in range(3)],
              1: [C.make_batch(310, image=False, audio=True)]}
    _checked(results, "fsdp2_uneven", lambda: _layout(world, dict(dp_shard=2), -1, uneven.get))
    # SP2 (one data rank), two of three batches, text, image and audio documents mixed.
    three = [C.make_batch(110 + i) for i in range(3)]
    _checked(results, "sp2", lambda: _layout(
        world, dict(dp_shard=1, sp=2), 2, lambda r: three, dict(n_kv_heads=1)))
    # Expert parallel 2 over FSDP 2 (MoE foundation): uneven ranks again, the padding forward
    # takes part in the experts' all-to-alls.
    _checked(results, "ep2_uneven", lambda: _layout(
        world, dict(dp_shard=2, ep=2), -1, uneven.get, dict(moe=True)))
    return results


@pytest.fixture(scope="module")
def two_rank():
    return run_distributed(_two_ranks, 2, timeout=600)


def _check(res, name):
    for r, ranks in enumerate(res):
        out = ranks[name]
        assert "error" not in out, f"rank {r}: {out.get('error')}"
        ref, got = out["ref"], out["first"]
        assert ref and set(ref) <= set(got), (sorted(ref), sorted(got))
        for key, value in ref.items():
            assert abs(got[key] - value) <= RTOL * abs(value), (key, got[key], value)
        # rewound each time: the second validation scores the same batches
        timed = "validation/time(s)"
        assert out["second"] == {**out["first"], timed: out["second"][timed]}
        assert out["train_mode"]  # back in training mode
    return res[0][name]


def test_fsdp2_uneven_ranks_whole_split(two_rank):
    out = _check(two_rank, "fsdp2_uneven")
    assert out["first"]["validation/batches"] == 3  # the longer rank's count, on every rank
    mixes = {"validation/mix/image", "validation/mix/audio", "validation/mix/text_only"}
    assert mixes <= set(out["ref"])


def test_sp2_steps_and_slices(two_rank):
    out = _check(two_rank, "sp2")
    assert out["first"]["validation/batches"] == 2


def test_ep2_uneven_ranks(two_rank):
    out = _check(two_rank, "ep2_uneven")
    assert out["first"]["validation/batches"] == 3
    assert any(k.startswith("validation/loss/") and "aux" in k for k in out["first"]), out["first"]


def test_logging_and_freq(two_rank):
    out = two_rank[0]["sp2"]
    assert [s for s, _ in out["logged"]] == [3, 6]
    step, metrics = out["logged"][0]
    total = sum(v for k, v in metrics.items() if k.startswith("validation/loss/"))
    assert abs(metrics["validation/loss"] - total) <= 1e-9 * abs(total)
    assert out["should"] == [False, False, True, False, False, True, False]
