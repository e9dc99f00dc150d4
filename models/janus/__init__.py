"""``janus``: Janus-style understanding (SigLIP) and generation (VQ) on a DeepSeek-LLM.

Flavors: ``debugmodel`` (images in and out, trains on 2 CPU cores) and ``1.3B``.
"""

from torchtitan.protocols.train_spec import register_train_spec

from torchtitan_omni.spec import omni_train_spec

from .args import FLAVORS, JanusArgs
from .model import PLAN, JanusModel, parallel_plan

NAME = "janus"

register_train_spec(NAME, omni_train_spec(JanusModel, FLAVORS))

__all__ = ["FLAVORS", "NAME", "PLAN", "parallel_plan", "JanusArgs", "JanusModel"]
