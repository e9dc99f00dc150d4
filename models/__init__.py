"""The model zoo: importing this package registers every omni train spec with TorchTitan.

``janus``, ``llama_omni``, ``qwen3_omni`` and ``qwen3_moe_omni``; see docs/models.md.
"""

# each registers its spec
from . import janus, llama_omni, qwen3_moe_omni, qwen3_omni  # noqa: F401
