"""What the model specs share: parallelism checks, the processing of their parts, and the
parallel-plan layouts of the foundation, encoders and decoders."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from torchtitan_omni.protocols.plan import PartLayout

#: the foundation's sub-modules wrapped by their own FSDP unit; ``tok_embeddings`` and
#: ``output`` are called directly by ``OmniModel`` (not through the foundation's forward), so
#: they must be units of their own
LLM_FSDP_UNITS = ("tok_embeddings", "layers.*", "output")
LLM_AC_UNITS = ("layers.*",)
LLM_ATTENTION = "llm.layers.*.attention"
MOE_EXPERTS = "llm.layers.*.moe.experts"


def check_parallelism(
    n_heads: int, n_kv_heads: int, ulysses_degree: int, expert_parallel_degree: int,
    num_experts: int | None = None,
) -> str | None:
    """One line naming the first problem of these degrees for an LLM of this shape, or None.

    Ulysses gives each rank ``n_heads / degree`` query heads and whole kv heads: kv heads are
    repeated ``degree / gcd(n_kv_heads, degree)`` times, which keeps q heads with their own kv
    heads whenever the degree divides the query heads.
    """
    if ulysses_degree < 1 or n_heads % ulysses_degree:
        return (f"parallelism.ulysses_degree ({ulysses_degree}) must divide the LLM's "
                f"{n_heads} query heads")
    repeat = ulysses_degree // math.gcd(n_kv_heads, ulysses_degree)
    if (n_kv_heads * repeat) % ulysses_degree or (n_heads // n_kv_heads) % repeat:
        return (f"parallelism.ulysses_degree ({ulysses_degree}) cannot split the LLM's "
                f"{n_kv_heads} kv heads (repeated {repeat}x) with its {n_heads} query heads")
    if expert_parallel_degree > 1:
        if not num_experts:
            return (f"parallelism.expert_parallel_degree ({expert_parallel_degree}) > 1 but "
                    "this model has no experts")
        if num_experts % expert_parallel_degree:
            return (f"parallelism.expert_parallel_degree ({expert_parallel_degree}) must divide "
                    f"the {num_experts} experts of each MoE layer")
    return None


def processing_of(parts: dict[str, nn.Module]) -> dict[str, object]:
    """Processor config per modality of encoders (all their modalities) and decoders."""
    out = {}
    for part in parts.values():
        modalities = getattr(part, "modalities", None)
        if modalities is not None:
            for modality in modalities:
                out[modality] = part.processing(modality)
        else:
            out[part.modality] = part.processing()
    return out


def build_on_meta(factory):
    """Call ``factory()`` on the meta device (shapes and configs only, no memory)."""
    with torch.device("meta"):
        return factory()


def llm_part() -> PartLayout:
    """The foundation: embeddings, each layer and the head as FSDP units; layers checkpointed."""
    return PartLayout("llm", fsdp_units=LLM_FSDP_UNITS, ac_units=LLM_AC_UNITS)


def encoder_part(name: str, encoder_cls) -> PartLayout:
    """An encoder, laid out as its class declares (``fsdp_units``, ``ac_units``)."""
    return PartLayout(
        f"encoders.{name}", fsdp_units=tuple(getattr(encoder_cls, "fsdp_units", ())),
        ac_units=tuple(getattr(encoder_cls, "ac_units", ())),
    )


def decoder_parts(name: str, decoder_cls) -> tuple[PartLayout, ...]:
    """A decoder's layouts: its frozen sub-modules first, each a replicated part of its own
    (they run only on ranks whose batch has targets, so a sharded one would hang), then the
    decoder with its FSDP units."""
    root = f"decoders.{name}"
    frozen = tuple(PartLayout(f"{root}.{unit}", mesh="none")
                   for unit in getattr(decoder_cls, "frozen_units", ()))
    return frozen + (PartLayout(root, fsdp_units=tuple(getattr(decoder_cls, "fsdp_units", ()))),)


def frozen_fp32_modules(name: str, decoder_cls) -> tuple[str, ...]:
    """A decoder's frozen sub-modules keep float32 weights (they take float32 pixels)."""
    return tuple(f"decoders.{name}.{unit}" for unit in getattr(decoder_cls, "frozen_units", ()))
