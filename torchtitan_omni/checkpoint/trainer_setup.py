"""How ``OmniTrainer`` gets its checkpoint manager and initial weights.

TorchTitan 0.2.2's ``Trainer.__init__`` always builds its own ``CheckpointManager`` from
``job_config.checkpoint``; there is no hook for another class. :func:`titan_checkpointer_off`
hands it a copy of ``[checkpoint]`` with ``enable`` off for that call, so what it builds is inert
(no folder, no purge thread, no process group), but its model wrapper still takes the model's
state dict and keeps it: :func:`drop_titan_checkpointer` lets it go (before a change of the
parameters' tensors, such as ``optimizer.expert_weights_dtype``'s). :func:`setup_checkpointing`
then installs the omni manager and loads ``weights.sources`` (unless a checkpoint will be
resumed that holds every weight; an adapter-only LoRA checkpoint holds only what trains, so the
base is loaded).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

from torchtitan.tools.logging import logger

from torchtitan_omni.checkpoint.manager import OmniCheckpointManager
from torchtitan_omni.checkpoint.weights import load_initial_weights
from torchtitan_omni.lora import lora_settings


@contextmanager
def titan_checkpointer_off(job_config) -> Iterator[None]:
    """While inside, ``job_config.checkpoint.enable`` reads False (a copy of the section; the
    job's own is put back on exit)."""
    section = job_config.checkpoint
    job_config.checkpoint = dataclasses.replace(section, enable=False)
    try:
        yield
    finally:
        job_config.checkpoint = section


def build_checkpoint_manager(trainer) -> OmniCheckpointManager:
    """An ``OmniCheckpointManager`` over the trainer's model, optimizer, scheduler and data."""
    cfg = trainer.job_config
    lora = None
    if cfg.lora.enable:
        lora = {**lora_settings(cfg.lora), "weights_sources": list(cfg.weights.sources),
                "init_seed": cfg.omni.init_seed}
    adapter_cls = trainer.train_spec.state_dict_adapter
    return OmniCheckpointManager(
        dataloader=trainer.dataloader,
        model_parts=trainer.model_parts,
        optimizers=trainer.optimizers,
        lr_schedulers=trainer.lr_schedulers,
        states={"train_state": trainer},
        checkpoint_config=cfg.checkpoint,
        sd_adapter=(adapter_cls(trainer.model_args, cfg.model.hf_assets_path)
                    if adapter_cls else None),
        base_folder=cfg.job.dump_folder,
        parallel_dims=trainer.parallel_dims,
        adapter_only=cfg.lora.enable and cfg.lora.save_adapter_only,
        lora=lora,
    )


def drop_titan_checkpointer(trainer) -> None:
    """Close and drop the inert manager TorchTitan built (see the module docstring), and the
    state dict it kept; ``trainer.checkpointer`` is None until :func:`setup_checkpointing`."""
    if trainer.checkpointer is not None:
        trainer.checkpointer.close()  # nothing to stop
        trainer.checkpointer = None


def setup_checkpointing(trainer) -> None:
    """Install the omni checkpoint manager and load the initial weights per part."""
    drop_titan_checkpointer(trainer)
    manager = build_checkpoint_manager(trainer)
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
