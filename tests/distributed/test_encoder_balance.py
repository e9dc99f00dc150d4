"""Encoder load balancing (``parallelism.encoder_sequence_parallel = "balance"``,
``torchtitan_omni.distributed.boundary``): the assignment, the boundary communicator's
forward and adjoint in float64 on 2 and 3 gloo ranks, the tiny omni model's losses and
gradients against the single-process reference, and run_train.sh's losses against the
default layout over steps where balancing moves items."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from torchtitan_omni.distributed.boundary import assign_items, imbalance, loads

P, D = 3, 4  # toy patch width and output width


# ----------------------------------------------------------------- assignment
SKEWED = [[400.0, 350.0, 300.0, 300.0, 250.0, 200.0, 200.0, 150.0, 120.0, 100.0, 80.0, 50.0],
          [20.0, 10.0], [], [60.0, 40.0, 40.0]]


def test_assignment_balances_a_skewed_batch():
    dest = assign_items(SKEWED)
    before, after = imbalance(loads(SKEWED)), imbalance(loads(SKEWED, dest))
    assert before > 3.0 and after <= 1.1, (before, after, loads(SKEWED, dest))
    # every item assigned once, to a rank of the group
    assert [len(d) for d in dest] == [len(c) for c in SKEWED]
    assert all(0 <= e < len(SKEWED) for d in dest for e in d)
    assert abs(sum(loads(SKEWED, dest)) - sum(map(sum, SKEWED))) < 1e-9


def test_assignment_is_deterministic_and_keeps_balanced_items_home():
    assert assign_items(SKEWED) == assign_items([list(c) for c in SKEWED])
    even = [[5.0, 3.0], [4.0, 4.0], [8.0]]
    assert assign_items(even) == [[0, 0], [1, 1], [2]]
    assert assign_items([[], []]) == [[], []]


def test_assignment_starts_from_the_forwards_earlier_loads():
    """A pass balances on top of the work earlier passes gave each rank: rank 0, already the
    busiest, hands its largest item to rank 1, where alone the items would all stay home."""
    costs = [[5.0, 3.0], [4.0, 4.0]]
    assert assign_items(costs) == [[0, 0], [1, 1]]
    dest = assign_items(costs, start=[10.0, 0.0])
    assert dest == [[1, 0], [1, 1]]
    assert loads(costs, dest, start=[10.0, 0.0]) == [13.0, 13.0]


def test_zoo_encoders_announce_their_output_rows():
    """The owner of an item must know its embedding rows before it is encoded elsewhere."""
    from tests.encoders import test_audio, test_siglip
    from torchtitan_omni.encoders.siglip import SiglipEncoder

    audio = test_audio.build()
    lengths = torch.tensor([33, 20, 7, 1])
    feats = torch.randn(4, test_audio.N_MELS, 33, dtype=torch.float64)
    media = {"features": feats, "lengths": lengths}
    assert audio.output_rows(media, "audio") == audio(media, "audio").shape[0]
    siglip = SiglipEncoder(test_siglip.tiny_args(), test_siglip.LLM_DIM)
    pixels = {"pixels": torch.randn(3, 3, 32, 32)}
    with torch.no_grad():
        assert siglip.output_rows(pixels, "image") == siglip(pixels, "image").shape[0]


def test_encoder_without_output_rows_is_refused():
    from torch import nn

    from torchtitan_omni.distributed.boundary import install_balanced_encoders
    from torchtitan_omni.protocols.modules import OmniEncoder

    class Bare(OmniEncoder):
        lm_encode = processing = dummy_media = init_weights = lambda self, *a: None

    with pytest.raises(ValueError, match="needs encoders with output_rows; vision"):
        install_balanced_encoders(nn.ModuleDict({"vision": Bare()}), group=None)


# ----------------------------------------------------------------- boundary communicator
def _toy_params():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(P, D, generator=g, dtype=torch.float64).requires_grad_(),
            torch.randn(D, D, generator=g, dtype=torch.float64).requires_grad_())


def _toy_encode(media, w1, w2):
    """Per-patch MLP plus each item's mean (items interact within, never across)."""
    grid, x = media["grid_thw"], media["patches"]
    rows = grid.prod(-1)
    h = torch.tanh(x @ w1)
    item = torch.repeat_interleave(torch.arange(len(rows)), rows)
    means = h.new_zeros(len(rows), D).index_add(0, item, h) / rows.unsqueeze(1).to(h.dtype)
    return (h + means[item]) @ w2


def _toy_media(rank, sizes):
    g = torch.Generator().manual_seed(100 + rank)
    grid = torch.tensor([[1, a, b] for a, b in sizes], dtype=torch.long).reshape(-1, 3)
    n = int(grid.prod(-1).sum())
    patches = torch.randn(n, P, generator=g, dtype=torch.float64).requires_grad_()
    return {"patches": patches, "grid_thw": grid}


# rank -> items (h, w); one rank with none, one with most of the work
ITEMS = {2: [[(4, 5), (3, 3), (6, 4), (1, 2)], []],
         3: [[(6, 6), (5, 4), (4, 4), (3, 2), (2, 2)], [(1, 3)], []]}
#: a second pass in the same forward: balanced alone, its items would stay home; on top of the
#: first pass's loads they move
ITEMS_B = {2: [[(2, 2)], [(3, 2)]], 3: [[(2, 2)], [(3, 2)], [(1, 1)]]}


def _rows(sizes) -> list[float]:
    return [float(a * b) for a, b in sizes]


def _boundary_pass(rank, world, items, ledger):
    """One balanced pass of the toy encoder (costs: patches) against this rank's items encoded
    locally: errors of the output and of the input and parameter gradients."""
    import torch.distributed as dist

    from torchtitan_omni.distributed.boundary import balanced_encode

    w1, w2 = _toy_params()
    media = _toy_media(rank, items[world][rank])
    out_rows = media["grid_thw"].prod(-1).tolist()
    dummy = {"patches": torch.zeros(1, P, dtype=torch.float64),
             "grid_thw": torch.ones(1, 3, dtype=torch.long)}
    out, stats = balanced_encode(media, lambda m: _toy_encode(m, w1, w2),
                                 _rows(items[world][rank]), out_rows,
                                 lambda: _toy_encode(dummy, w1, w2)[:0], dist.group.WORLD,
                                 ledger=ledger)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + rank),
                         dtype=torch.float64)
    (out * weight).sum().backward()
    # the encoder's gradient is the sum over ranks (what FSDP's reduce-scatter does)
    gw = [w.grad.clone() for w in (w1, w2)]
    for g in gw:
        dist.all_reduce(g)

    # reference: this rank's items encoded locally, one process
    r1, r2 = _toy_params()
    ref_media = _toy_media(rank, items[world][rank])
    ref_out = _toy_encode(ref_media, r1, r2)
    (ref_out * weight).sum().backward()
    ref_gw = [w.grad.clone() for w in (r1, r2)]
    for g in ref_gw:
        dist.all_reduce(g)
    return {"out": (out - ref_out).abs().max().item() if out.numel() else 0.0,
            "rows": (out.shape[0], ref_out.shape[0]),
            "input_grad": (media["patches"].grad - ref_media["patches"].grad).abs().max().item()
            if out.numel() else 0.0,
            "param_grad": max((a - b).abs().max().item() for a, b in zip(gw, ref_gw)),
            "stats": stats, "loads": list(ledger.loads)}


def _boundary(rank, world):
    from torchtitan_omni.distributed.boundary import BalanceLedger

    ledger = BalanceLedger()
    return [_boundary_pass(rank, world, items, ledger) for items in (ITEMS, ITEMS_B)]


@pytest.mark.parametrize("world", [2, 3])
def test_boundary_forward_and_adjoint_match_local_encoding(world):
    """Two passes of one forward through the boundary communicator: outputs and gradients
    equal local encoding; the second pass starts from the first pass's loads (the ledger)."""
    results = run_distributed(_boundary, world, timeout=180)
    for rank, passes in enumerate(results):
        for res in passes:
            assert res["rows"][0] == res["rows"][1], (rank, res)
            assert res["out"] < 1e-12 and res["input_grad"] < 1e-12, (rank, res)
            assert res["param_grad"] < 1e-12, (rank, res)
    first, second = results[0]
    before, after = first["stats"]
    assert after < before, first["stats"]
    # the ledger after each pass: the loads every rank computes from the published costs
    costs_a = [_rows(sizes) for sizes in ITEMS[world]]
    loads_a = loads(costs_a, assign_items(costs_a))
    costs_b = [_rows(sizes) for sizes in ITEMS_B[world]]
    loads_b = loads(costs_b, assign_items(costs_b, loads_a), loads_a)
    assert all(p[0]["loads"] == loads_a and p[1]["loads"] == loads_b for p in results), results
    # balanced alone, the second pass would leave its items home and the forward's work less
    # even than with the first pass's loads carried
    assert assign_items(costs_b) == [[r] * len(c) for r, c in enumerate(costs_b)]
    alone = loads(costs_b, None, loads_a)
    assert imbalance(loads_b) < imbalance(alone), (loads_b, alone)
    assert second["stats"] == (pytest.approx(imbalance(alone)), pytest.approx(imbalance(loads_b)))


# ----------------------------------------------------------------- tiny omni model
def _model_layouts(rank, world):
    from tests.distributed import common as C
    from tests.distributed.test_parity import _checked, _layout_check
    from torchtitan_omni.distributed.boundary import BalancedMediaEncoder, balance_metrics

    def installed(model, **_):
        encoders = model.encoders.values()
        return {"balanced": all(isinstance(e, BalancedMediaEncoder) for e in encoders),
                "stats": model.encoders["vision"]._omni_balance_stats,
                "metrics": balance_metrics(model.encoders)}

    balance = dict(parallelism__encoder_sequence_parallel="balance")
    results = {}
    # rank 0's batch has only images, rank 1's only audio: each encoder has a rank on a dummy
    mixed = lambda ndp: [C.make_batch(200, image=True, audio=False),
                         C.make_batch(201, image=False, audio=True)][:ndp]
    _checked(results, "fsdp2_mixed", lambda: _layout_check(
        world, "balance", C.ModelSpec(), dict(dp_shard=2), balance, mixed, extra=installed))
    two = lambda ndp: [C.make_batch(300 + i) for i in range(ndp)]
    _checked(results, "fsdp2", lambda: _layout_check(
        world, "balance", C.ModelSpec(), dict(dp_shard=2), balance, two, extra=installed))
    # Ulysses: the SP ranks share one batch, each owns a share of its items
    _checked(results, "sp2", lambda: _layout_check(
        world, "balance", C.ModelSpec(), dict(dp_shard=1, sp=2), balance,
        lambda ndp: [C.make_batch(110)], extra=installed))
    return results


def test_tiny_model_losses_and_gradients_match_reference():
    results = run_distributed(_model_layouts, 2, timeout=600)
    # the images-only rank hands work to the audio-only one
    before, after = results[0]["fsdp2_mixed"]["stats"]
    assert after < before, (before, after)
    # what the trainer logs (TensorBoard): each encoder's last pass, the same on every rank
    metrics = results[0]["fsdp2_mixed"]["metrics"]
    assert metrics["encoders/vision/cost_max_over_mean_before"] == before
    assert metrics["encoders/vision/cost_max_over_mean_after"] == after
    assert metrics == results[1]["fsdp2_mixed"]["metrics"]
    for rank, res in enumerate(results):
        for name, out in res.items():
            assert "error" not in out, (rank, name, out.get("error"))
            assert out["balanced"] and out["stats"] is not None, (rank, name)
            assert out["loss_err"] < 1e-5, (rank, name, out["losses"], out["ref_losses"])
            assert not out["grad_problems"], (rank, name, out["grad_problems"][:5])
            assert out["ref_encoder_grad"], (rank, name)


def _dp_sp_layout(rank, world):
    from tests.distributed import common as C
    from tests.distributed.test_parity import _checked, _layout_check

    results = {}
    mixed = lambda ndp: [C.make_batch(200, image=True, audio=False),
                         C.make_batch(201, image=False, audio=True)][:ndp]
    _checked(results, "dp2_sp2", lambda: _layout_check(
        world, "balance", C.ModelSpec(), dict(dp_shard=2, sp=2),
        dict(parallelism__encoder_sequence_parallel="balance"), mixed))
    return results


def test_tiny_model_dp2_sp2_matches_reference():
    for rank, res in enumerate(run_distributed(_dp_sp_layout, 4, timeout=600)):
        out = res["dp2_sp2"]
        assert "error" not in out, (rank, out.get("error"))
        assert out["loss_err"] < 1e-5, (rank, out["losses"], out["ref_losses"])
        assert not out["grad_problems"], (rank, out["grad_problems"][:5])


# ----------------------------------------------------------------- run_train.sh
#: 4 steps of two micro-batches on each of 2 ranks: at step 4 the audio clips of the two
#: ranks differ enough that balancing moves some (step 4's imbalance 1.96 -> 1.19)
BALANCE_RUN = ("--training.steps", "4", "--lr_scheduler.warmup_steps", "1",
               "--debug.deterministic", "--debug.seed", "42", "--training.local_batch_size", "1",
               "--training.global_batch_size", "4")


@pytest.mark.slow
def test_llama_omni_balance_losses_match_default(tmp_path):
    """Balanced encoders through the launcher on 2 processes, the encoders run by increasing
    work (the default ``omni.encoder_order``, which the log names), against the replicated
    ones in the model's order: items do move (some step's imbalance after balancing is below
    the one before), and every step's named losses and gradient norm stay within 1e-5."""
    from tests.distributed.test_noncolocated_trainer import DEBUG, _train

    orders = {"replicate": "model", "balance": "work"}
    runs = {layout: _train(DEBUG, str(tmp_path / layout), 2,
                           "--parallelism.encoder_sequence_parallel", layout,
                           "--omni.encoder_order", order, common=BALANCE_RUN)
            for layout, order in orders.items()}
    base, bal = runs["replicate"]["steps"], runs["balance"]["steps"]
    assert sorted(base) == sorted(bal) == [1, 2, 3, 4], (base, bal)
    assert "Encoders balance media items over 2 ranks" in runs["balance"]["run"].output
    # the order of step 1 (the debug rows' speech clips cost more FLOPs than their images)
    assert ('(omni.encoder_order = "work"); step 1: vision, audio'
            in runs["balance"]["run"].output), runs["balance"]["run"].output[-3000:]
    assert "omni.encoder_order" not in runs["replicate"]["run"].output
    moved = [(step, name) for step, record in bal.items()
             for name, before in record.get("balance", {}).items()
             if name.endswith("_before")
             and record["balance"][name.replace("_before", "_after")] < before - 1e-6]
    assert moved, {step: record.get("balance") for step, record in bal.items()}
    assert all("balance" not in record for record in base.values())
    for step, record in base.items():
        for name, value in record.items():
            assert abs(bal[step][name] - value) <= 1e-5, (step, name, base, bal)
