"""What ``OmniTrainer.__init__`` calls after TorchTitan's set-up: swap in the omni checkpoint
manager and load ``weights.sources`` (unless a checkpoint will be resumed that holds every
weight; an adapter-only LoRA checkpoint holds only what trains, so the base is loaded)."""

from __future__ import annotations

from torchtitan.tools.logging import logger

from torchtitan_omni.checkpoint.manager import OmniCheckpointManager
from torchtitan_omni.checkpoint.weights import load_initial_weights
from torchtitan_omni.lora import lora_settings


def build_checkpoint_manager(trainer) -> OmniCheckpointManager:
    """An ``OmniCheckpointManager`` over the trainer's model, optimizer, scheduler and data."""
    cfg = trainer.job_config
    lora = None
    if cfg.lora.enable:
        lora = {**lora_settings(cfg.lora), "weights_sources": list(cfg.weights.sources),
                "init_seed": cfg.omni.init_seed}
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
        adapter_only=cfg.lora.enable and cfg.lora.save_adapter_only,
        lora=lora,
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
    if resume is not None and manager.holds_base_weights(resume):
        logger.info(f"weights.sources not loaded: the model comes from the checkpoint {resume}")
        return
    if resume is not None:
        logger.info(f"The checkpoint {resume} holds only what LoRA trains: the base weights "
                    "come from weights.sources")
    model = trainer.model_parts[0]
    load_initial_weights(model, list(sources))
