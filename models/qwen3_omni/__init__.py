"""``qwen3_omni``: Qwen3 dense + vision, video and audio understanding.

Flavors: ``debugmodel`` (every modality, trains on 2 CPU cores) and ``8B``.
"""

from torchtitan.protocols.train_spec import register_train_spec

from torchtitan_omni.spec import omni_train_spec

from .args import FLAVORS, Qwen3OmniArgs
from .model import PLAN, Qwen3OmniModel, parallel_plan

NAME = "qwen3_omni"

register_train_spec(NAME, omni_train_spec(Qwen3OmniModel, FLAVORS))

__all__ = ["FLAVORS", "NAME", "PLAN", "parallel_plan", "Qwen3OmniArgs", "Qwen3OmniModel"]
