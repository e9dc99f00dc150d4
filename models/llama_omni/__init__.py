"""``llama_omni``: Llama-3 + vision, video and audio understanding + image generation.

Flavors: ``debugmodel`` (every modality, trains on 2 CPU cores) and ``8B``.
"""

from torchtitan.protocols.train_spec import register_train_spec

from torchtitan_omni.spec import omni_train_spec

from .args import FLAVORS, LlamaOmniArgs
from .model import PLAN, LlamaOmniModel, parallel_plan

NAME = "llama_omni"

register_train_spec(NAME, omni_train_spec(LlamaOmniModel, FLAVORS))

__all__ = ["FLAVORS", "NAME", "PLAN", "parallel_plan", "LlamaOmniArgs", "LlamaOmniModel"]
