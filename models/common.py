"""What the model specs share: the parallel-plan layouts of the foundation, encoders and
decoders."""

from __future__ import annotations

from torchtitan_omni.protocols.plan import PartLayout

#: the foundation's sub-modules wrapped by their own FSDP unit; ``tok_embeddings`` and
#: ``output`` are called directly by ``OmniModel`` (not through the foundation's forward), so
#: they must be units of their own
LLM_FSDP_UNITS = ("tok_embeddings", "layers.*", "output")
#: a head tied to the embedding shares its parameter: the two are one FSDP unit (a group),
#: gathered from the embedding lookup to the head's loss
LLM_TIED_GROUPS = (("tok_embeddings", "output"),)
LLM_AC_UNITS = ("layers.*",)
#: the head runs last in the forward and first in the backward: left gathered in between
LLM_GATHERED_AFTER_FORWARD = ("output",)
LLM_ATTENTION = "llm.layers.*.attention"
MOE_EXPERTS = "llm.layers.*.moe.experts"


def llm_part(tied: bool = False) -> PartLayout:
    """The foundation: embeddings, each layer and the head as FSDP units (embedding and head as
    one unit when ``tied``); layers checkpointed; the head (its unit) left gathered from its
    forward to its backward."""
    if tied:
        return PartLayout("llm", fsdp_units=("layers.*",), ac_units=LLM_AC_UNITS,
                          fsdp_groups=LLM_TIED_GROUPS,
                          gathered_after_forward=LLM_GATHERED_AFTER_FORWARD)
    return PartLayout("llm", fsdp_units=LLM_FSDP_UNITS, ac_units=LLM_AC_UNITS,
                      gathered_after_forward=LLM_GATHERED_AFTER_FORWARD)


def encoder_part(name: str, encoder_cls) -> PartLayout:
    """An encoder, laid out as its class declares (``fsdp_units``, ``ac_units``)."""
    return PartLayout(
        f"encoders.{name}", fsdp_units=tuple(getattr(encoder_cls, "fsdp_units", ())),
        ac_units=tuple(getattr(encoder_cls, "ac_units", ())),
    )


def decoder_parts(name: str, decoder_cls) -> tuple[PartLayout, ...]:
    """A decoder's layouts: its frozen sub-modules first, each a replicated part of its own
    (frozen and small: sharding them would only add all-gathers), then the decoder with its
    FSDP units."""
    root = f"decoders.{name}"
    frozen = tuple(PartLayout(f"{root}.{unit}", mesh="none")
                   for unit in getattr(decoder_cls, "frozen_units", ()))
    return frozen + (PartLayout(root, fsdp_units=tuple(getattr(decoder_cls, "fsdp_units", ()))),)


def frozen_fp32_modules(name: str, decoder_cls) -> tuple[str, ...]:
    """A decoder's frozen sub-modules keep float32 weights (they take float32 pixels)."""
    return tuple(f"decoders.{name}.{unit}" for unit in getattr(decoder_cls, "frozen_units", ()))
