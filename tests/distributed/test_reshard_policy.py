"""``parallelism.fsdp_reshard_after_forward`` on 2 gloo ranks: which FSDP units hold their
gathered parameters between the forward and the backward. "default" leaves the plan's
``gathered_after_forward`` units (the LLM head) gathered and reshards the rest, as TorchTitan's
default leaves its head gathered; "always" reshards every unit, "never" none. Each policy's
step must still give the single-process reference's losses."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import DTensor

from tests.distributed import common as C
from tests.harness import run_distributed

#: one unit of each kind: the head, a layer, the embedding, an encoder block
UNITS = ("llm.output", "llm.layers.0.attention.wq", "llm.tok_embeddings",
         "encoders.vision.attn.wq")


def _gathered_after_forward(rank, world, policy):
    dims = C.make_dims(world)
    cfg = C.job_config(parallelism__fsdp_reshard_after_forward=policy)
    spec = C.ModelSpec()
    model = C.parallel_model(spec, dims, cfg)
    seen = {}

    def after_forward(module, args, output):
        # a unit's weight is a plain tensor while gathered, its DTensor shard once resharded
        seen.update({unit: not isinstance(model.get_submodule(unit).weight, DTensor)
                     for unit in UNITS})

    model.register_forward_hook(after_forward)
    batches = [C.make_batch(300 + r) for r in range(world)]  # one per data rank
    losses = C.parallel_step(model, dims, *batches[rank])
    reference = C.reference_step(C.reference_model(spec), batches)
    return seen, losses, reference


@pytest.mark.parametrize("policy, gathered", [
    ("default", {"llm.output"}),
    ("always", set()),
    ("never", set(UNITS)),
])
def test_units_left_gathered_after_the_forward_follow_the_policy(policy, gathered):
    for seen, losses, reference in run_distributed(_gathered_after_forward, 2, policy):
        assert {unit for unit, held in seen.items() if held} == gathered
        assert losses.keys() == reference.keys()
        for name, value in losses.items():
            assert abs(value - reference[name]) <= 1e-5 * max(1.0, abs(reference[name])), name


def _previous_block_gathered(rank, world, per_unit):
    dims = C.make_dims(world)
    cfg = C.job_config(parallelism__llm_blocks_per_fsdp_unit=per_unit)
    spec = C.ModelSpec(layers=4)
    model = C.parallel_model(spec, dims, cfg)
    seen = {}

    def on_block(index):
        def before_forward(module, args):
            # the block before this one: still gathered only if it shares this block's unit
            weight = model.get_submodule(f"llm.layers.{index - 1}.attention.wq").weight
            seen[index] = not isinstance(weight, DTensor)
        return before_forward

    for index in range(1, spec.layers):
        model.get_submodule(f"llm.layers.{index}").register_forward_pre_hook(on_block(index))
    batches = [C.make_batch(400 + r) for r in range(world)]
    losses = C.parallel_step(model, dims, *batches[rank])
    reference = C.reference_step(C.reference_model(spec), batches)
    return seen, losses, reference


@pytest.mark.parametrize("per_unit, gathered", [
    (1, set()),
    (2, {1, 3}),  # blocks 0-1 and 2-3 are units: block 0 waits for block 1's forward
    (3, {1, 2}),  # blocks 0-2 and the shorter last group, block 3
])
def test_llm_blocks_grouped_into_units(per_unit, gathered):
    """``parallelism.llm_blocks_per_fsdp_unit``: a block's parameters stay gathered until the
    last block of its group has run, and the step still gives the reference's losses."""
    for seen, losses, reference in run_distributed(_previous_block_gathered, 2, per_unit):
        assert {index for index, held in seen.items() if held} == gathered
        assert losses.keys() == reference.keys()
        for name, value in losses.items():
            assert abs(value - reference[name]) <= 1e-5 * max(1.0, abs(reference[name])), name
