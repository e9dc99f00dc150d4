"""Loss and gradient parity of FSDP2, Ulysses SP (sync and async), expert parallel and their
combinations against a single-process reference on the same global batch (float32, gloo).

Two process spawns (2 and 4 ranks) run every layout in turn, each on a fresh model and mesh;
each test below checks one layout's result. The reference runs in each rank's process on an
unsharded copy with the same layout-invariant init.
"""

from __future__ import annotations

import traceback

import pytest
import torch

from tests.harness import run_distributed

RTOL = 1e-5


def _layout_check(world, name, spec, dims_kw, cfg_kw, batches_fn, extra=None,
                  ref_capacity=False):
    """Run one layout: parallel step on this rank, reference step, compare. Returns a dict.
    ``ref_capacity``: the reference applies the job's expert capacity batch by batch."""
    from tests.distributed import common as C
    from torchtitan_omni.distributed.parallelize import capacity_tokens

    dims = C.make_dims(world, **dims_kw)
    cfg = C.job_config(**cfg_kw)
    model = C.parallel_model(spec, dims, cfg)
    ndp = dims.dp_replicate * dims.dp_shard
    dp = dims.get_mesh("batch").get_local_rank() if dims.dp_enabled else 0
    batches = batches_fn(ndp)
    losses = C.parallel_step(model, dims, *batches[dp])
    grads = C.full_grads(model)
    ref = C.reference_model(spec)
    if ref_capacity:
        C.with_capacity(ref, cfg.parallelism.expert_capacity_factor, capacity_tokens(cfg, dims.sp))
    ref.freeze(list(cfg.omni.freeze))
    ref_losses = C.reference_step(ref, batches)
    out = {
        "losses": losses, "ref_losses": ref_losses,
        "loss_err": max(C.rel_error(losses[k], ref_losses[k]) for k in ref_losses),
        "grad_problems": C.compare(grads, ref, RTOL),
        # a check that cannot fail is no check: the reference must have real encoder gradients
        "ref_encoder_grad": {
            n: float(p.grad.abs().sum()) for n, p in ref.named_parameters()
            if n.startswith("encoders.") and n.endswith("proj.weight") and p.grad is not None
        },
    }
    if extra is not None:
        out.update(extra(model=model, ref=ref, dims=dims, cfg=cfg, grads=grads, batches=batches))
    return out


def _checked(results, name, fn):
    try:
        results[name] = fn()
    except Exception:  # noqa: BLE001  (recorded; ranks fail alike)
        results[name] = {"error": traceback.format_exc()}


# ----------------------------------------------------------------- extra checks
def _sync_vs_async(world, spec, dims_kw, batches_fn, **job_kw):
    """Gradients and losses of sync and async Ulysses (both with ``job_kw`` settings) on the
    same batch: max abs difference, and the head groups the async runner pipelined."""
    from tests.distributed import common as C

    out = {}
    for mode in (False, True):
        dims = C.make_dims(world, **dims_kw)
        model = C.parallel_model(spec, dims, C.job_config(parallelism__ulysses_async=mode,
                                                          **job_kw))
        ndp = dims.dp_replicate * dims.dp_shard
        dp = dims.get_mesh("batch").get_local_rank() if dims.dp_enabled else 0
        attn = model.llm.layers["0"].attention
        out[mode] = (C.parallel_step(model, dims, *batches_fn(ndp)[dp]), C.full_grads(model),
                     type(attn.runner).__name__)
        groups = attn.runner.head_chunks if mode else None  # as the runner resolved them
    (l0, g0, r0), (l1, g1, r1) = out[False], out[True]
    diff = max((g0[n] - g1[n]).abs().max().item() for n in g0 if g0[n] is not None)
    return {"runners": (r0, r1), "grad_max_diff": diff, "head_groups": groups,
            "loss_diff": max(abs(l0[k] - l1[k]) for k in l0),
            "bitwise": all(torch.equal(g0[n], g1[n]) for n in g0 if g0[n] is not None)}


def _frozen_extra(model, ref, dims, cfg, grads, batches):
    """Frozen parameters: no gradient, no optimizer state; trainable ones step."""
    from torchtitan.components.optimizer import build_optimizers

    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    with_grad = [n for n in frozen if grads[n] is not None]
    opt = build_optimizers([model], cfg.optimizer, dims)
    opt.step()
    inner = opt.optimizers[0]
    params = dict(model.named_parameters())
    with_state = [n for n in frozen if params[n] in inner.state]
    trainable_state = sum(1 for n, p in params.items() if p.requires_grad and p in inner.state)
    return {"frozen": frozen, "frozen_with_grad": with_grad, "frozen_with_state": with_state,
            "trainable_with_state": trainable_state}


def _clip_extra(model, ref, dims, cfg, grads, batches):
    """``clip_grad_norm_`` over parameters on several meshes vs. the reference's norm, and the
    clipped gradients."""
    from tests.distributed import common as C
    from torchtitan_omni.distributed.utils import clip_grad_norm_

    meshes = sorted({str(getattr(p.grad, "device_mesh", None).mesh_dim_names)
                     for p in model.parameters() if p.grad is not None})
    norm = float(clip_grad_norm_(list(model.parameters()), 0.1))
    ref_norm = float(torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.1))
    return {"norm": norm, "ref_norm": ref_norm, "grad_meshes": meshes,
            "clipped_problems": C.compare(C.full_grads(model), ref, RTOL)}


def _expert_placements(model, ref, dims, cfg, grads, batches):
    w1 = model.llm.layers["0"].moe.experts.w1
    from torch.distributed.tensor import Shard

    return {"expert_placements": [p == Shard(1) for p in w1.placements],
            "expert_mesh": w1.device_mesh.mesh_dim_names}


def _moe_counts_extra(model, ref, dims, cfg, grads, batches):
    """This rank's routed and dropped copies per layer and expert, and the reference's on the
    same batch (the reference layer applies the same capacity rule)."""
    from tests.distributed import common as C

    counts = model.llm.moe_counts()
    dp = dims.get_mesh("batch").get_local_rank() if dims.dp_enabled else 0
    batch, labels = batches[dp]
    meta, media = C._meta(batch)
    with torch.no_grad():
        ref(batch[C.B.INPUT], meta, labels, **media)
    return {"counts": counts.tolist(), "ref_counts": ref.llm.moe_counts().tolist(),
            "dispatcher": type(model.llm.layers["0"].moe.dispatcher).__name__}


def _split_extra(model, ref, dims, cfg, grads, batches):
    from torchtitan_omni.distributed.encoder_sp import SplitMediaEncoder

    return {"split_installed": isinstance(model.encoders["vision"], SplitMediaEncoder)}


# ----------------------------------------------------------------- 2 ranks
def _two_ranks(rank, world):
    from tests.distributed import common as C

    Spec = C.ModelSpec
    results = {}
    # FSDP2 (dp_shard 2); rank 0's batch has only images, rank 1's only audio.
    mixed = lambda ndp: [
        C.make_batch(200, image=True, audio=False),
        C.make_batch(201, image=False, audio=True),
    ][:ndp]
    _checked(results, "fsdp2_mixed", lambda: _layout_check(
        world, "fsdp2", Spec(), dict(dp_shard=2), {}, mixed))
    # SP2 with one kv head (< degree): packing and media crossing the slice boundary.
    crossing = lambda ndp: [C.make_batch(110)]
    _checked(results, "sp2_gqa", lambda: {
        **_layout_check(world, "sp2", Spec(n_kv_heads=1), dict(dp_shard=1, sp=2), {}, crossing),
        "crosses": C.crosses_slices(crossing(1)[0][0], 2)})
    _checked(results, "sp2_sync_vs_async", lambda: _sync_vs_async(
        world, Spec(n_kv_heads=1), dict(dp_shard=1, sp=2), crossing))
    # the heads pipelined in two groups (8 q and 4 kv heads over 2 ranks: the most that fit,
    # by default; each group's q heads read their own kv heads), under full AC (the recompute
    # pipelines its exchanges again)
    _checked(results, "sp2_async_head_groups", lambda: _sync_vs_async(
        world, Spec(n_heads=8, n_kv_heads=4), dict(dp_shard=1, sp=2), crossing,
        activation_checkpoint__mode="full"))
    # EP2 over the two data ranks (Qwen3-MoE foundation).
    two = lambda ndp: [C.make_batch(300 + i) for i in range(ndp)]
    _checked(results, "ep2", lambda: _layout_check(
        world, "ep2", Spec(moe=True), dict(dp_shard=2, ep=2), {}, two))
    # EP2 borrowing the SP ranks, async Ulysses, one row; clipping over dense and expert meshes.
    _checked(results, "ep2_sp2", lambda: _layout_check(
        world, "ep2_sp2", Spec(moe=True), dict(dp_shard=1, sp=2, ep=2),
        dict(parallelism__ulysses_async=True), lambda n: [C.make_batch(110, rows=1, seq=32)],
        extra=_clip_extra))
    # EP2 with capacity-padded dispatch (C = 16 slots of 64 copies per rank): copies dropped,
    # counted, and the single-process reference applying the same rule gives the same step.
    capacity = dict(parallelism__expert_capacity_factor=1.0, training__seq_len=16,
                    training__local_batch_size=2)
    _checked(results, "ep2_capacity", lambda: _layout_check(
        world, "ep2_capacity", Spec(moe=True), dict(dp_shard=2, ep=2), capacity, two,
        extra=_moe_counts_extra, ref_capacity=True))
    # Encoders splitting media items over SP ranks; one image only, so a rank encodes a dummy.
    one_image = lambda ndp: [C.make_batch(100)]
    _checked(results, "sp2_split_encoders", lambda: _layout_check(
        world, "split", Spec(), dict(dp_shard=1, sp=2),
        dict(parallelism__encoder_sequence_parallel="split"), one_image, extra=_split_extra))
    # Frozen audio encoder and token embedding, vision encoder replicated ("none"), full AC.
    _checked(results, "frozen_none_ac", lambda: _layout_check(
        world, "frozen", Spec(), dict(dp_shard=2),
        dict(omni__freeze=["encoders.audio", "llm.tok_embeddings"],
             parallelism__encoder_fsdp_mesh="none", activation_checkpoint__mode="full",
             omni__encoder_activation_checkpoint="full"),
        two, extra=_frozen_extra))
    # Per-op selective AC around async Ulysses (the recomputation re-issues the all-to-alls).
    _checked(
        results,
        "selective_ac",
        lambda: _layout_check(
            world,
            "sac",
            Spec(layers=2),
            dict(dp_shard=1, sp=2),
            dict(
                activation_checkpoint__mode="selective",
                activation_checkpoint__selective_ac_option="op",
                parallelism__ulysses_async=True,
            ),
            crossing,
        ),
    )
    return results


@pytest.fixture(scope="module")
def two_rank():
    return run_distributed(_two_ranks, 2, timeout=600)


def _assert_parity(res, name):
    for r, ranks in enumerate(res):
        out = ranks[name]
        assert "error" not in out, f"rank {r}: {out.get('error')}"
        assert out["loss_err"] < RTOL, f"rank {r}: losses {out['losses']} vs {out['ref_losses']}"
        assert not out["grad_problems"], f"rank {r}: " + "; ".join(out["grad_problems"][:8])
    return res[0][name]


def test_fsdp2_with_different_modality_mixes(two_rank):
    out = _assert_parity(two_rank, "fsdp2_mixed")
    assert (
        all(v > 0 for v in out["ref_encoder_grad"].values()) and len(out["ref_encoder_grad"]) == 2
    )


def test_sp2_gqa_kv_heads_below_degree_with_crossing_documents(two_rank):
    out = _assert_parity(two_rank, "sp2_gqa")
    assert out["crosses"] == (True, True), "the batch must cross the SP slice boundary"


@pytest.mark.parametrize("case, groups", [("sp2_sync_vs_async", 1),
                                          ("sp2_async_head_groups", 2)])
def test_async_ulysses_matches_sync(two_rank, case, groups):
    for ranks in two_rank:
        out = ranks[case]
        assert "error" not in out, out.get("error")
        assert out["runners"] == ("UlyssesRunner", "AsyncUlyssesRunner")
        assert out["head_groups"] == groups, out
        assert out["loss_diff"] == 0.0 and out["grad_max_diff"] <= 1e-7, out


def test_ep2(two_rank):
    _assert_parity(two_rank, "ep2")


def test_ep2_with_sp2_and_clipping(two_rank):
    out = _assert_parity(two_rank, "ep2_sp2")
    assert abs(out["norm"] - out["ref_norm"]) <= RTOL * out["ref_norm"], out
    assert not out["clipped_problems"], out["clipped_problems"][:5]
    assert len(out["grad_meshes"]) >= 2, out["grad_meshes"]  # dense and expert meshes


def _assert_counts(res, name, drops: bool):
    for r, ranks in enumerate(res):
        out = ranks[name]
        assert out["dispatcher"] == "CapacityExpertParallelDispatcher", out["dispatcher"]
        assert out["counts"] == out["ref_counts"], (r, out["counts"], out["ref_counts"])
    dropped = sum(sum(sum(layer) for layer in ranks[name]["counts"][1]) for ranks in res)
    assert (dropped > 0) == drops, dropped


def test_ep2_capacity_drops_like_the_reference(two_rank):
    _assert_parity(two_rank, "ep2_capacity")
    _assert_counts(two_rank, "ep2_capacity", drops=True)


def test_sp2_encoders_split_media_items(two_rank):
    out = _assert_parity(two_rank, "sp2_split_encoders")
    assert out["split_installed"]


def test_frozen_parts_replicated_encoder_and_full_ac(two_rank):
    out = _assert_parity(two_rank, "frozen_none_ac")
    assert out["frozen"] and not out["frozen_with_grad"] and not out["frozen_with_state"], out
    assert out["trainable_with_state"] > 0


def test_selective_op_ac_under_sp(two_rank):
    _assert_parity(two_rank, "selective_ac")


# ----------------------------------------------------------------- 4 ranks
def _four_ranks(rank, world):
    from tests.distributed import common as C

    Spec = C.ModelSpec
    results = {}
    # dp_shard 2 x sp 2: dp rank 0 has only images, dp rank 1 only audio; encoders sharded
    # over dp_shard only (replicated over SP), async Ulysses, every layer checkpointed.
    mixed = lambda ndp: [
        C.make_batch(110, image=True, audio=False),
        C.make_batch(104, image=False, audio=True),
    ]
    _checked(results, "dp2_sp2_mixed", lambda: _layout_check(
        world, "dp2sp2", Spec(), dict(dp_shard=2, sp=2),
        dict(parallelism__ulysses_async=True, parallelism__encoder_fsdp_mesh="dp_shard",
             activation_checkpoint__mode="full"), mixed))
    # EP2 over dp_shard 2 x sp 2 (efsdp 2), encoders splitting items, clipping.
    two = lambda ndp: [C.make_batch(110), C.make_batch(105)]
    _checked(results, "dp2_sp2_ep2", lambda: _layout_check(
        world, "dp2sp2ep2", Spec(moe=True), dict(dp_shard=2, sp=2, ep=2),
        dict(parallelism__encoder_sequence_parallel="split"), two, extra=_clip_extra))
    # EP4 with capacity-padded dispatch, two experts per rank, copies dropped.
    capacity = dict(parallelism__expert_capacity_factor=1.0, training__seq_len=16,
                    training__local_batch_size=2)
    four = lambda ndp: [C.make_batch(400 + i) for i in range(ndp)]
    _checked(results, "ep4_capacity", lambda: _layout_check(
        world, "ep4_capacity", Spec(moe=True, experts=8), dict(dp_shard=4, ep=4), capacity, four,
        extra=_moe_counts_extra, ref_capacity=True))
    # Capacity-padded EP2 x SP2 x FSDP (dp_shard 2) with room for every copy (factor E / k:
    # C = tokens): exactly the exact dispatch's step.
    no_drop = dict(capacity, parallelism__expert_capacity_factor=2.0)
    _checked(results, "dp2_sp2_ep2_capacity", lambda: _layout_check(
        world, "dp2sp2ep2cap", Spec(moe=True), dict(dp_shard=2, sp=2, ep=2), no_drop, two,
        extra=_moe_counts_extra))
    # HSDP: dp_replicate 2 x sp 2, encoders replicated everywhere.
    _checked(results, "hsdp_sp2", lambda: _layout_check(
        world, "hsdp", Spec(n_kv_heads=1), dict(dp_replicate=2, dp_shard=1, sp=2),
        dict(parallelism__encoder_fsdp_mesh="none"), two))
    # HSDP with expert parallel: experts on (dp_replicate, efsdp), EP over dp_shard 2.
    _checked(results, "hsdp_ep2", lambda: _layout_check(
        world, "hsdp_ep", Spec(moe=True), dict(dp_replicate=2, dp_shard=2, ep=2), {}, four))
    # One expert per EP rank, FSDP-sharded over efsdp 2 on dim 1 (dim 0 cannot be split).
    _checked(results, "ep2_efsdp2_dim1", lambda: {
        **_layout_check(world, "ep_dim1", Spec(moe=True, experts=2), dict(dp_shard=4, ep=2), {},
                        four, extra=_expert_placements)})
    return results


@pytest.fixture(scope="module")
def four_rank():
    return run_distributed(_four_ranks, 4, timeout=600)


def test_dp2_sp2_with_different_modality_mixes(four_rank):
    out = _assert_parity(four_rank, "dp2_sp2_mixed")
    assert (
        all(v > 0 for v in out["ref_encoder_grad"].values()) and len(out["ref_encoder_grad"]) == 2
    )


def test_dp2_sp2_ep2_split_encoders_and_clipping(four_rank):
    out = _assert_parity(four_rank, "dp2_sp2_ep2")
    assert abs(out["norm"] - out["ref_norm"]) <= RTOL * out["ref_norm"], out
    assert not out["clipped_problems"], out["clipped_problems"][:5]


def test_ep4_capacity_drops_like_the_reference(four_rank):
    _assert_parity(four_rank, "ep4_capacity")
    _assert_counts(four_rank, "ep4_capacity", drops=True)


def test_dp2_sp2_ep2_capacity_without_drops_is_exact(four_rank):
    _assert_parity(four_rank, "dp2_sp2_ep2_capacity")
    for r, ranks in enumerate(four_rank):
        counts = ranks["dp2_sp2_ep2_capacity"]["counts"]
        assert ranks["dp2_sp2_ep2_capacity"]["dispatcher"] == "CapacityExpertParallelDispatcher"
        assert sum(map(sum, counts[1])) == 0 and sum(map(sum, counts[0])) > 0, f"rank {r}"


def test_hsdp_with_sp2_and_replicated_encoders(four_rank):
    _assert_parity(four_rank, "hsdp_sp2")


def test_hsdp_with_ep2(four_rank):
    _assert_parity(four_rank, "hsdp_ep2")


def test_experts_fsdp_sharded_on_dim1_over_efsdp(four_rank):
    out = _assert_parity(four_rank, "ep2_efsdp2_dim1")
    assert out["expert_mesh"] == ("efsdp", "ep"), out
    assert out["expert_placements"] == [True, False], out  # (Shard(1) on efsdp, Shard(0) on ep)
