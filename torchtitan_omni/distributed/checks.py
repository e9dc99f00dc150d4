"""Start-up checks of a model against the parallel degrees: one clear line per problem.

Model specs call :func:`ulysses_problem` and :func:`expert_problem` from their args'
``validate_parallelism``; ``torchtitan_omni.config.validate`` also runs :func:`plan_problem`
on the model built on the meta device, so a spec that forgets a check still fails at start-up,
not in the middle of the first step.
"""

from __future__ import annotations

import torch.nn as nn

from torchtitan_omni.distributed.parallelize import matching_modules


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
                 capacity_factor: float = 0.0) -> str | None:
    """The first problem of the model's declared plan at these degrees, or None."""
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
