"""Each spec's ``debugmodel``: forward and backward on a batch mixing every modality it
supports, its plan and processing, the parallelism checks, FSDP on two ranks whose batches hold
different modality mixes (gradients equal the single-process ones), and 20 steps of
``run_train.sh`` on the bundled data."""

from __future__ import annotations

import math

import pytest
import torch

import torchtitan_omni.models  # noqa: F401  (registers the specs)
from tests.harness import run_distributed, run_train
from tests.models.batches import mixed_batch
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan_omni.distributed.parallelize import matching_modules
from torchtitan_omni.protocols import batch as B
from torchtitan_omni.protocols.modules import AttentionMeta

SPECS = ["janus", "llama_omni", "qwen3_omni", "qwen3_moe_omni"]
MODALITIES = {
    "janus": {"image", "gen_image"},
    "llama_omni": {"image", "video", "audio", "gen_image"},
    "qwen3_omni": {"image", "video", "audio"},
    "qwen3_moe_omni": {"image", "video", "audio"},
}


def _debug_model(name: str):
    spec = get_train_spec(name)
    args = spec.model_args["debugmodel"]
    model = spec.model_cls(args)
    model.init_weights()
    return model, args


def _forward(model, batch: dict, labels: torch.Tensor):
    batch = dict(batch)
    cu = batch.pop(B.CU_SEQLENS)
    meta = AttentionMeta(cu, int((cu[1:] - cu[:-1]).max()), batch.pop(B.POSITION_IDS))
    tokens = batch.pop(B.INPUT)
    batch.pop(B.REAL_TOKENS)
    out = model(tokens, meta, labels, **batch)
    return sum(out.losses.values()) + sum(out.aux_losses.values()), out


@pytest.mark.parametrize("name", SPECS)
def test_forward_backward_mixing_every_modality(name):
    model, args = _debug_model(name)
    assert set(model.modalities) == MODALITIES[name]
    batch, labels = mixed_batch(model, args.llm_args.vocab_size)
    for modality in model.modalities:
        assert (batch[B.embed_index_key(modality)] >= 0).any(), modality
    loss, out = _forward(model, batch, labels)
    expected = {"text"} | ({"gen_image"} & MODALITIES[name])
    assert set(out.losses) == expected
    assert set(out.aux_losses) == ({"moe_aux"} if name == "qwen3_moe_omni" else set())
    assert all(math.isfinite(float(v)) and float(v) > 0 for v in out.losses.values())
    loss.backward()
    silent = [n for n, p in model.named_parameters()
              if p.requires_grad and (p.grad is None or not p.grad.abs().sum() > 0)]
    assert not silent, f"parameters without gradient: {silent}"
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert all(".vq." in n for n in frozen), frozen  # only the VQ tokenizer is frozen


@pytest.mark.parametrize("name", SPECS)
def test_processing_and_plan_cover_the_model(name):
    spec = get_train_spec(name)
    args = spec.model_args["debugmodel"]
    assert set(args.processing()) == MODALITIES[name]
    with torch.device("meta"):
        model = spec.model_cls(args)
    plan = model.parallel_plan
    roots = {p.root for p in plan.parts}
    assert {"llm"} | {f"encoders.{n}" for n in model.encoders} | {
        f"decoders.{n}" for n in model.decoders} <= roots
    for part in plan.parts:
        model.get_submodule(part.root)
        for pattern in part.fsdp_units + part.ac_units:
            assert matching_modules(model, part.root, (pattern,)), (part.root, pattern)
    units = {n for n, _ in matching_modules(model, "llm", plan.part("llm").fsdp_units)}
    assert {"llm.tok_embeddings", "llm.output"} <= units  # OmniModel calls them directly
    attention = matching_modules(model, "", plan.sequence_parallel_attention)
    assert len(attention) == args.llm_args.n_layers
    experts = matching_modules(model, "", plan.experts)
    assert len(experts) == (args.llm_args.n_layers if name == "qwen3_moe_omni" else 0)
    for _, module in experts:
        assert module.active_fraction == args.llm_args.top_k / args.llm_args.num_experts


def test_validate_parallelism_names_the_problem():
    qwen = get_train_spec("qwen3_moe_omni").model_args["30B-A3B"]
    assert qwen.validate_parallelism(8, 8) is None  # 32 q heads, 4 kv heads repeated 2x
    assert "ulysses_degree (3)" in qwen.validate_parallelism(3, 1)
    assert "expert_parallel_degree (3)" in qwen.validate_parallelism(1, 3)
    janus = get_train_spec("janus").model_args["1.3B"]
    assert janus.validate_parallelism(16, 1) is None
    assert "no experts" in janus.validate_parallelism(1, 2)
    assert "attention heads" in janus.validate_parallelism(32, 1)


# ----------------------------------------------------------------- FSDP on two ranks
def _fsdp_worker(rank: int, world_size: int, names: list[str]) -> dict:
    from torchtitan_omni.config.manager import OmniConfigManager
    from torchtitan_omni.distributed.parallel_dims import OmniParallelDims
    from torchtitan_omni.distributed.parallelize import parallelize_omni

    report = {}
    for name in names:
        cfg = OmniConfigManager().parse_args(
            [
                "--model.name",
                name,
                "--model.flavor",
                "debugmodel",
                "--training.dataset",
                "omni_default",
                "--activation_checkpoint.mode",
                "none",
                "--model.hf_assets_path",
                "/nonexistent",
            ]
        )
        dims = OmniParallelDims.from_config(cfg.parallelism, world_size)
        dims.build_mesh()
        spec = get_train_spec(name)
        args = spec.model_args["debugmodel"]
        reference, _ = _debug_model(name)
        with torch.device("meta"):
            model = spec.model_cls(args)
        parallelize_omni(model, dims, cfg)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights()

        def rank_batch(r, reference=reference, args=args):
            batch, labels = mixed_batch(reference, args.llm_args.vocab_size, seed=r)
            if r == 1:  # no encoder media on rank 1: its encoders run on dummies
                for modality in reference.encoder_of:
                    for key in [k for k in batch if k.startswith(modality + "_")]:
                        del batch[key]
            return batch, labels

        _forward(model, *rank_batch(rank))[0].backward()
        # The reference sees both ranks' batches; FSDP sums gradients over ranks.
        sum(_forward(reference, *rank_batch(r))[0] for r in range(world_size)).backward()
        ref_grads = dict(reference.named_parameters())
        worst, compared = 0.0, 0
        for n, p in model.named_parameters():
            if p.grad is None:
                assert not p.requires_grad, n
                continue
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            ref = ref_grads[n].grad
            assert ref.abs().max() > 0, f"{name}: {n} has no reference gradient"
            worst = max(worst, float((grad - ref).abs().max() / ref.abs().max()))
            compared += 1
        report[name] = (worst, compared)
    return report


def test_fsdp_two_ranks_with_different_modality_mixes_match_one_process():
    reports = run_distributed(_fsdp_worker, 2, SPECS)
    for name in SPECS:
        worst, compared = reports[0][name]
        assert compared > 20 and worst < 1e-5, (name, worst, compared)


# ----------------------------------------------------------------- run_train.sh
#: steps of the loss-decrease runs: the mean of the last 5 losses is 1.9-2.9 below that of the
#: first 5 by step 20 on every spec (1.2-2.2 by step 15, so 20 keeps a margin over the 1.0
#: asserted); 30 steps only took longer (~0.5-1 s a step on 2 cores)
LOSS_STEPS = 20


@pytest.mark.slow
@pytest.mark.parametrize("name", SPECS)
def test_loss_decreases_over_20_steps_on_bundled_data(name):
    run = run_train(f"train_configs/{name}_debug.toml", 2, "--training.steps", str(LOSS_STEPS),
                    "--job.dump_folder", f"outputs/test_{name}_debug")
    assert run.returncode == 0, run.output[-3000:]
    losses = run.loss_list()
    assert len(losses) == LOSS_STEPS and all(math.isfinite(v) for v in losses), losses
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, losses
    for named in run.named.values():
        assert set(named) >= {"text"} | ({"gen_image"} & MODALITIES[name])
