"""Start-up checks of a model against the parallel degrees: one clear line per problem.

Model specs call :func:`ulysses_problem` and :func:`expert_problem` from their args'
``validate_parallelism``; ``torchtitan_omni.config.validate`` also runs :func:`plan_problem`
on the model built on the meta device, so a spec that forgets a check still fails at start-up,
not in the middle of the first step, and :func:`parts_problem`, which checks the per-part
layouts (``parallelism.parts``) against the parts the model has, and
:func:`fsdp_unit_problem` (``fsdp_unit`` "part" where it could not act).
"""

from __future__ import annotations

import difflib
from typing import Any, cast

import torch.nn as nn

from torchtitan_omni.distributed.part_layouts import (
    DECODERS, ENCODER_ONLY, key_name, part_settings)
from torchtitan_omni.distributed.parallelize import matching_modules
from torchtitan_omni.distributed.ulysses import head_chunks
from torchtitan_omni.protocols.modules import OmniEncoder


def ulysses_problem(
    n_heads: int, n_kv_heads: int, degree: int, where: str = "the model"
) -> str | None:
    """Why Ulysses at ``degree`` cannot split this attention, or None.

    Each rank takes ``n_heads / degree`` q heads; kv heads are repeated (at most up to the q
    heads) until every rank gets whole ones, which is possible exactly when ``degree`` divides
    ``n_heads`` (= ``n_kv_heads`` x the GQA repeat).
    """
    if degree <= 1:
        return None
    if n_heads % degree:
        return (
            f"parallelism.ulysses_degree ({degree}) must divide the attention heads of {where}: "
            f"{n_heads} q heads = {n_kv_heads} kv heads x {n_heads // max(n_kv_heads, 1)} repeat"
        )
    return None


def expert_problem(num_experts: int, degree: int, where: str = "the model") -> str | None:
    """Why expert parallel at ``degree`` cannot split these experts, or None."""
    if degree > 1 and num_experts % degree:
        return (
            f"parallelism.expert_parallel_degree ({degree}) must divide the {num_experts} "
            f"experts of {where}"
        )
    return None


def plan_problem(model: nn.Module, ulysses_degree: int, expert_parallel_degree: int,
                 capacity_factor: float = 0.0, async_head_chunks: int | None = None
                 ) -> str | None:
    """The first problem of the model's declared plan at these degrees, or None;
    ``async_head_chunks``: async Ulysses' head groups (None: synchronous Ulysses)."""
    plan = getattr(model, "parallel_plan", None)
    if plan is None:
        return None
    if ulysses_degree > 1:
        attns = matching_modules(model, "", plan.sequence_parallel_attention)
        if not attns:
            return (
                f"parallelism.ulysses_degree is {ulysses_degree} but {type(model).__name__}'s "
                "plan lists no sequence-parallel attention"
            )
        for name, attn in attns:
            problem = ulysses_problem(attn.n_heads, attn.n_kv_heads, ulysses_degree, name)
            if problem:
                return problem
            if async_head_chunks is not None:
                try:
                    head_chunks(cast(int, attn.n_heads), cast(int, attn.n_kv_heads),
                                ulysses_degree, async_head_chunks)
                except ValueError as e:
                    return f"{name}: {e}"
    if expert_parallel_degree > 1:
        experts = matching_modules(model, "", plan.experts)
        if not experts:
            return (
                f"parallelism.expert_parallel_degree is {expert_parallel_degree} but "
                f"{type(model).__name__} has no experts in its plan"
            )
        for name, module in experts:
            params = list(module.parameters(recurse=False))
            if params:
                problem = expert_problem(params[0].shape[0], expert_parallel_degree, name)
                if problem:
                    return problem
    if capacity_factor > 0 and not matching_modules(model, "", plan.experts):
        return (
            f"parallelism.expert_capacity_factor is {capacity_factor} but "
            f"{type(model).__name__} has no experts in its plan"
        )
    return None


def _unknown_part(model: nn.Module, part: str, names: list[str]) -> str:
    listed = ", ".join(names) or "none"
    if part == "llm" or part.startswith("llm."):
        return (f"{key_name(part)}: the foundation is laid out by [activation_checkpoint] and "
                f"the parallel degrees; parallelism.parts takes encoders and decoders ({listed})")
    close = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return (f"{key_name(part)}: {type(model).__name__} has no part {part!r} (its encoders and "
            f"decoders: {listed}){hint}")


def parts_problem(model: nn.Module, job_config: Any, encoder_ranks: int) -> str | None:
    """The first problem of the per-part layouts (``parallelism.parts``) on this model, or
    None: a part the model does not have, a key the part does not take (a decoder's
    ``sequence_parallel``), a key that could not act (a mesh for a part outside the plan,
    checkpointing for a part without ``ac_units``), and "balance" on an encoder without
    ``output_rows`` (from either key) when ``encoder_ranks`` (data x SP ranks) > 1."""
    encoders = getattr(model, "encoders", None) or {}
    decoders = getattr(model, "decoders", None) or {}
    names = [f"encoders.{n}" for n in encoders] + [f"decoders.{n}" for n in decoders]
    plan = getattr(model, "parallel_plan", None)
    layouts = plan.parts if plan is not None else ()
    for part, table in (job_config.parallelism.parts or {}).items():
        if part not in names:
            return _unknown_part(model, part, names)
        if part.startswith(DECODERS):
            for key, why in ENCODER_ONLY.items():
                if key in table:
                    return (f"{key_name(part, key)}: decoders take no {key} ({why}); set it "
                            "on encoders")
        own = [p for p in layouts if p.root == part or p.root.startswith(part + ".")]
        if "fsdp_mesh" in table and not own:
            return (f"{key_name(part, 'fsdp_mesh')} cannot act: {type(model).__name__}'s "
                    f"parallel plan has no layout for {part}")
        mode = table.get("activation_checkpoint", "none")
        if mode != "none" and not any(p.ac_units for p in own):
            return (f'{key_name(part, "activation_checkpoint")} = "{mode}" cannot act: the '
                    f"parallel plan of {part} lists no activation-checkpoint units (ac_units)")
    if encoder_ranks > 1:
        for name, encoder in encoders.items():
            part = f"encoders.{name}"
            settings = part_settings(job_config, part)
            if settings.sequence_parallel != "balance":
                continue
            if getattr(type(encoder), "output_rows", None) is OmniEncoder.output_rows:
                key = (key_name(part, "sequence_parallel") if "sequence_parallel" in settings.own
                       else "parallelism.encoder_sequence_parallel")
                return (f'{key} = "balance" needs encoders with output_rows; {part} '
                        f"({type(encoder).__name__}) has none")
    return None


def fsdp_unit_problem(model: nn.Module, job_config: Any, data_ranks: int) -> str | None:
    """An encoder's own table saying ``fsdp_unit = "part"`` where it could not act, or None:
    the encoders on one rank (``data_ranks``: the data x SP ranks, or the non-colocated
    encoder ranks; no FSDP), or an encoder without blocks of its own. The global
    ``parallelism.encoder_fsdp_unit`` is a default ("part") for the encoders it can act on,
    like ``encoder_fsdp_mesh``, and is not refused."""
    tables = job_config.parallelism.parts or {}
    own = [part for part, table in tables.items() if table.get("fsdp_unit") == "part"]
    if not own:
        return None
    if data_ranks == 1:
        return (f'{key_name(own[0], "fsdp_unit")} = "part" cannot act: the encoders run on one '
                "rank, nothing is FSDP-sharded")
    plan = getattr(model, "parallel_plan", None)
    layouts = plan.parts if plan is not None else ()
    for part in own:
        if not any(p.fsdp_units or p.fsdp_groups for p in layouts if p.root == part):
            return (f'{key_name(part, "fsdp_unit")} = "part" cannot act: the parallel plan of '
                    f"{part} lists no FSDP blocks (it is one unit already)")
    return None
