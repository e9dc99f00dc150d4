"""Weights in and out of a sharded omni model.

- ``weights``/``hf_loader``: initial weights per part from Hugging Face safetensors folders
  (each rank reads only its slices) or DCP checkpoints (``[weights] sources``);
- ``manager``: ``OmniCheckpointManager``, TorchTitan's DCP checkpointing made crash-safe
  (``completion``) and reshardable (model, optimizer, dataloader; ``stateful``);
- ``hf_export``: DCP checkpoints to Hugging Face folders and back
  (``scripts/convert_checkpoint.py``).

See docs/checkpointing.md.
"""

from torchtitan_omni.checkpoint.trainer_setup import (
    drop_titan_checkpointer,
    setup_checkpointing,
    titan_checkpointer_off,
)

__all__ = ["drop_titan_checkpointer", "setup_checkpointing", "titan_checkpointer_off"]
