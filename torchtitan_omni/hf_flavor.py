"""``model.flavor = "hf"`` and ``model.parts_flavor``: a model's args shaped by the job.

- ``apply_hf_flavor``: the foundation's args from the ``config.json`` of the ``weights.sources``
  entry for ``llm`` (the spec's ``hf_foundations`` say which architectures it accepts), and each
  encoder's from its own folder's ``config.json`` when ``weights.sources`` names one
  (``torchtitan_omni.encoders.hf_config``). Decoders keep their args (no reader yet; the loader
  checks every shape against their folders).
- ``apply_parts_flavor``: the encoders' and decoders' args copied from another flavor of the
  spec, e.g. the tiny ``debugmodel`` parts around a real foundation on CPU.

Errors are single lines (``HFConfigError``, ``ConfigError``) naming the key, file and what is
supported.
"""

from __future__ import annotations

import copy
import os

from torchtitan.protocols.train_spec import get_train_spec
from torchtitan.tools.logging import logger

from torchtitan_omni.checkpoint.weights import parse_sources
from torchtitan_omni.encoders.hf_config import encoder_args
from torchtitan_omni.errors import ConfigError, HFConfigError
from torchtitan_omni.foundations.hf_config import CONFIG_FILE, foundation_args, read_hf_config
from torchtitan_omni.protocols.model import HF_FLAVOR


def weight_sources(job_config) -> dict[str, str]:
    """``weights.sources`` as part -> path."""
    return {s.part: s.path for s in parse_sources(list(job_config.weights.sources))}


def apply_parts_flavor(args, job_config) -> None:
    """Set the encoders' and decoders' args to ``model.parts_flavor``'s; without one, undo
    what an earlier job in this process put there (``parts_flavor``, encoder configs)."""
    name = getattr(job_config.model, "parts_flavor", "")
    if not name or name == job_config.model.flavor:
        args.restore_own_parts()
        return
    flavors = get_train_spec(job_config.model.name).model_args
    if name == HF_FLAVOR or name not in flavors:
        choices = ", ".join(f for f in flavors if f != HF_FLAVOR)
        raise ConfigError(f"model.parts_flavor {name!r} is not a flavor of "
                          f"{job_config.model.name} with its own parts (flavors: {choices})")
    args.keep_own_parts()
    for field, value in flavors[name].own_parts().items():
        setattr(args, field, copy.deepcopy(value))


def apply_hf_flavor(args, job_config) -> None:
    """Foundation (and encoder) args from the Hugging Face folders of ``weights.sources``."""
    sources = weight_sources(job_config)
    spec = job_config.model.name
    path = sources.get("llm")
    if path is None:
        raise HFConfigError(
            f"model.flavor = 'hf' builds the LLM of {spec} from the config.json of the "
            "weights.sources entry for 'llm', and there is none (add --weights.sources "
            "llm=/path/to/hf_folder)")
    config = read_hf_config(path, "llm")
    where = os.path.join(path, CONFIG_FILE)
    args.llm = foundation_args(config, type(args).hf_foundations, where, spec)
    log_once(f"LLM of {spec} from {where}: {describe(args.llm)}")
    fields = set(args.part_fields())
    for part, folder in sources.items():
        kind, _, name = part.partition(".")
        if kind != "encoders" or name not in fields:
            continue  # the LLM, decoders, sub-modules: their args stay
        if not os.path.isfile(os.path.join(folder, CONFIG_FILE)):
            continue  # a DCP checkpoint of our own model: same args
        where = os.path.join(folder, CONFIG_FILE)
        args.keep_own_parts()
        setattr(args, name, encoder_args(getattr(args, name), read_hf_config(folder, part), where))
        log_once(f"{part} of {spec} from {where}: {getattr(args, name)}")


_logged: set[str] = set()


def log_once(message: str) -> None:
    """Log ``message`` once per process: model args are shaped several times (start-up
    check, data loader, trainer)."""
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


def describe(llm) -> str:
    """A foundation's shape on one line."""
    experts = f", {llm.num_experts} experts top-{llm.top_k}" if hasattr(llm, "num_experts") else ""
    head = "tied head" if llm.tie_word_embeddings else "untied head"
    return (f"{llm.n_layers} layers, width {llm.dim}, {llm.n_heads}/{llm.n_kv_heads} heads of "
            f"{llm.resolved_head_dim}{experts}, vocabulary {llm.vocab_size}, {head}")
