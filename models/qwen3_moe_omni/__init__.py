"""``qwen3_moe_omni``: Qwen3-MoE + vision, video and audio understanding.

Flavors: ``debugmodel`` (every modality, trains on 2 CPU cores) and ``30B-A3B``.
"""

from torchtitan.protocols.train_spec import register_train_spec

from torchtitan_omni.spec import omni_train_spec

from .args import FLAVORS, Qwen3MoeOmniArgs
from .model import PLAN, Qwen3MoeOmniModel, parallel_plan

NAME = "qwen3_moe_omni"

register_train_spec(NAME, omni_train_spec(Qwen3MoeOmniModel, FLAVORS))

__all__ = ["FLAVORS", "NAME", "PLAN", "parallel_plan", "Qwen3MoeOmniArgs", "Qwen3MoeOmniModel"]
