"""Start-up checks of non-colocated encoders (``[parallelism.parts."encoders.<name>"] ranks``).

The trainer runs one layout: every encoder on the same disjoint rank set, the LLM (and the
decoders) data parallel over the other ranks, each set FSDP-sharded over itself
(``torchtitan_omni.distributed.rank_sets``). Each combination it does not run is refused
here, before any process starts, with one line naming the key; ``validate_job_config``
calls :func:`ranks_problem` on the config and :func:`model_ranks_problem` on the model built
on the meta device.
"""

from __future__ import annotations

from typing import Any

from torchtitan.config import JobConfig

from torchtitan_omni.distributed.part_layouts import ENCODERS, RANKS_KEY, key_name

#: (what the config says, the key to name) -> not run with non-colocated encoders
_UNSUPPORTED = (
    (lambda c: c.parallelism.data_parallel_replicate_degree > 1,
     "parallelism.data_parallel_replicate_degree", "HSDP"),
    (lambda c: c.parallelism.ulysses_degree > 1, "parallelism.ulysses_degree",
     "Ulysses sequence parallel"),
    (lambda c: c.parallelism.tensor_parallel_degree > 1, "parallelism.tensor_parallel_degree",
     "tensor parallel"),
    (lambda c: c.parallelism.pipeline_parallel_degree > 1,
     "parallelism.pipeline_parallel_degree", "pipeline parallel"),
    (lambda c: c.parallelism.expert_parallel_degree > 1, "parallelism.expert_parallel_degree",
     "expert parallel"),
    (lambda c: c.parallelism.encoder_sequence_parallel != "replicate",
     "parallelism.encoder_sequence_parallel", "encoders split or balanced over ranks"),
    (lambda c: c.compile.enable, "compile.enable", "torch.compile"),
    (lambda c: c.lora.enable, "lora.enable", "LoRA"),
    (lambda c: bool(c.weights.sources), "weights.sources", "initial weights per part"),
    (lambda c: bool(c.model.converters), "model.converters", "model converters (float8)"),
    (lambda c: c.training.enable_cpu_offload, "training.enable_cpu_offload", "CPU offload"),
    (lambda c: c.omni.activation_offload, "omni.activation_offload", "activation offload"),
    (lambda c: c.omni.encoder_order != "model", "omni.encoder_order",
     "an encoder order by work (the encoder ranks replay the model's)"),
)


#: ``parallelism.encoder_schedule``'s values (``distributed.encoder_schedule``)
SCHEDULES = ("sync", "pipelined")


def _rank_tables(cfg: JobConfig) -> dict[str, Any]:
    return {part: table[RANKS_KEY] for part, table in (cfg.parallelism.parts or {}).items()
            if RANKS_KEY in table}


def ranks_problem(cfg: JobConfig, world_size: int) -> str | None:
    """The first problem of the ``ranks`` keys and of what goes with them, or None (also
    when no table sets ``ranks``). ``world_size``: the launch's processes."""
    tables = _rank_tables(cfg)
    schedule = cfg.parallelism.encoder_schedule
    if schedule not in SCHEDULES:
        return f'parallelism.encoder_schedule = "{schedule}": use "sync" or "pipelined"'
    if not tables:
        if schedule != "sync":
            return (f'parallelism.encoder_schedule = "{schedule}" needs non-colocated encoders '
                    '([parallelism.parts."encoders.<name>"] ranks); colocated encoders run '
                    "within the LLM's forward")
        return None
    for part, ranks in tables.items():
        key = key_name(part, RANKS_KEY)
        if not part.startswith(ENCODERS):
            return (f"{key}: only encoders run on their own ranks (the foundation and the "
                    "decoders run on the remaining ranks)")
        if not ranks:
            return f"{key} is empty: name the encoder ranks, e.g. [0]"
        if len(set(ranks)) != len(ranks):
            return f"{key} = {ranks} names a rank twice"
        outside = [r for r in ranks if not 0 <= r < world_size]
        if outside:
            return (f"{key} = {ranks}: rank {outside[0]} is outside the {world_size} processes "
                    f"(0 to {world_size - 1})")
        if len(ranks) == world_size:
            return (f"{key} = {ranks} takes every rank: the LLM needs ranks of its own (launch "
                    "more processes, or drop the key for colocated encoders)")
    first, first_ranks = next(iter(tables.items()))
    for part, ranks in tables.items():
        if sorted(ranks) != sorted(first_ranks):
            return (f"{key_name(part, RANKS_KEY)} = {ranks} differs from "
                    f"{key_name(first, RANKS_KEY)} = {first_ranks}: every encoder runs on "
                    "the same ranks")
    for part, table in (cfg.parallelism.parts or {}).items():
        mode = table.get("sequence_parallel", "replicate")
        if mode != "replicate":
            return (f'{key_name(part, "sequence_parallel")} = "{mode}" with non-colocated '
                    'encoders: the encoder ranks share items by cost; use "replicate"')
    for applies, key, what in _UNSUPPORTED:
        if applies(cfg):
            return (f"{key}: {what} is not supported with non-colocated encoders "
                    f"({key_name(first, RANKS_KEY)})")
    return None


def model_ranks_problem(cfg: JobConfig, encoders: list[str]) -> str | None:
    """What the model's encoders (their names) say against the ``ranks`` keys: an encoder
    without them while another has them, and every encoder frozen."""
    tables = _rank_tables(cfg)
    if not tables:
        return None
    first = key_name(next(iter(tables)), RANKS_KEY)
    for name in encoders:
        if f"{ENCODERS}{name}" not in tables:
            return (f"{key_name(ENCODERS + name, RANKS_KEY)} is not set while {first} is: "
                    "every encoder runs on the same ranks (set it on each encoder)")
    freeze = set(cfg.omni.freeze)
    if "encoders" in freeze or all(f"{ENCODERS}{n}" in freeze for n in encoders):
        return (f"omni.freeze = {sorted(freeze)} freezes every encoder: the encoder ranks of "
                f"{first} would have nothing to train (drop the key for colocated encoders)")
    return None
