"""What every model spec's args share with the rest of the framework, below any implementation:
the name of the Hugging Face flavor, and the foundation's block count under ``omni.llm_layers``.

The args base class itself, ``OmniModelArgs``, lives in ``torchtitan_omni.model_args``: it
shapes itself from the job (tokenizer, Hugging Face configs, FLOPs), which this layer must not
import.
"""

from __future__ import annotations

#: the flavor every omni spec registers whose foundation comes from a Hugging Face config.json
HF_FLAVOR = "hf"


def flavor_layers(llm) -> int:
    """The foundation's block count as its flavor declares it (before ``omni.llm_layers``)."""
    return getattr(llm, "flavor_n_layers", None) or llm.n_layers


def llm_layers_problem(keep: int, llm) -> str | None:
    """A one-line problem with ``omni.llm_layers = keep`` for this foundation, or None."""
    full = flavor_layers(llm)
    if keep < 0 or keep > full:
        return (f"omni.llm_layers ({keep}) must be between 1 and the flavor's {full} layers "
                "(0 keeps all)")
    return None


def apply_llm_layers(llm, keep: int) -> str | None:
    """Cut the foundation to its first ``keep`` blocks (0: the flavor's count). The flavor's
    count is remembered because TorchTitan updates the registered (shared) args in place."""
    problem = llm_layers_problem(keep, llm)
    if problem:
        return problem
    full = flavor_layers(llm)
    llm.flavor_n_layers = full
    llm.n_layers = keep or full
    return None
