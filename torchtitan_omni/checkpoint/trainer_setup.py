"""What ``OmniTrainer.__init__`` calls after TorchTitan's set-up: swap in the omni checkpoint
manager and load ``weights.sources`` (unless a checkpoint will be resumed, which holds every
weight)."""

from __future__ import annotations

from torchtitan.tools.logging import logger

from torchtitan_omni.checkpoint.manager import OmniCheckpointManager
from torchtitan_omni.checkpoint.weights import load_initial_weights


def build_checkpoint_manager(trainer) -> OmniCheckpointManager:
    """An ``OmniCheckpointManager`` over the trainer's model, optimizer, scheduler and data."""
    cfg = trainer.job_config
    return OmniCheckpointManager(
        dataloader=trainer.dataloader,
        model_parts=trainer.model_parts,
        optimizers=trainer.optimizers,
        lr_schedulers=trainer.lr_schedulers,
        states={"train_state": trainer},
        checkpoint_config=cfg.checkpoint,
        sd_adapter=getattr(trainer.checkpointer, "sd_adapter", None),
        base_folder=cfg.job.dump_folder,
        parallel_dims=trainer.parallel_dims,
    )


def setup_checkpointing(trainer) -> None:
    """Replace TorchTitan's checkpoint manager and load the initial weights per part."""
    manager = build_checkpoint_manager(trainer)
    trainer.checkpointer.close()  # TorchTitan's: stops its purge thread
    trainer.checkpointer = manager
    sources = trainer.job_config.weights.sources
    if not sources:
        return
    resume = manager.will_load()
    if resume is not None:
        logger.info(f"weights.sources not loaded: the model comes from the checkpoint {resume}")
        return
    model = trainer.model_parts[0]
    load_initial_weights(model, list(sources))
