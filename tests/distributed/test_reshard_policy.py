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
