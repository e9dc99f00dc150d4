"""``OmniCheckpointManager``: TorchTitan's checkpoint manager, crash-safe and reshardable.

What it adds to ``torchtitan.components.checkpoint.CheckpointManager`` (whose saving, async
modes, intervals and purge thread it keeps):

- every save is written aside and published atomically with a manifest
  (``torchtitan_omni.checkpoint.completion``); resume takes the newest *complete* full
  checkpoint, logs every folder it skipped and why, and makes sure all ranks chose the same;
- per-rank RNG states and a dataloader state that can be re-split over another number of data
  ranks (``torchtitan_omni.checkpoint.stateful``);
- before DCP reads anything, every model and optimizer tensor is checked against the
  checkpoint's metadata, so a checkpoint of another model fails with the tensor names instead
  of a planner error;
- ``keep_latest_k`` counts only published checkpoints, so an in-flight save never costs a
  complete one;
- LoRA (``lora.save_adapter_only``): saves keep only the model tensors that train (adapters,
  ``lora.train_modules``) and record it in the manifest; resuming such a checkpoint reads only
  them (the frozen base comes from ``weights.sources``, ``trainer_setup``), and a model-only
  base checkpoint without adapters loads into a LoRA model with the adapters left as
  initialized.

Model and optimizer states are DCP state dicts with full FQNs (``get_model_state_dict``,
``get_optimizer_state_dict``), so a checkpoint saved under one layout (FSDP4) loads under
another (FSDP2 x SP2, 2 ranks, EP1): DCP reads, for every local shard, the saved chunks that
overlap it.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.components.checkpoint import DATALOADER, MODEL, OPTIMIZER
from torchtitan.tools.logging import logger

from torchtitan_omni.checkpoint.completion import (
    Candidate,
    publish,
    read_manifest,
    remove_interrupted_saves,
    resolve_checkpoint,
    scan,
    step_dir,
    step_of,
    tmp_dir,
    verify,
)
from torchtitan_omni.checkpoint.optimizer_state import CompleteOptimizerState
from torchtitan_omni.checkpoint.parts import state_tensors
from torchtitan_omni.checkpoint.stateful import RNG, DataloaderState, RNGState
from torchtitan_omni.compat import TitanCheckpointManager
from torchtitan_omni.distributed.utils import all_reduce_world
from torchtitan_omni.errors import CheckpointFormatError
from torchtitan_omni.modules.lora import adapter_names, is_adapter_key
from torchtitan_omni.platform import local_device

_MAX_LISTED = 20


def layout_of(parallel_dims) -> dict[str, Any]:
    """The parallel degrees a checkpoint records (RNG states are restored only under equal).
    With non-colocated encoders (``distributed.rank_sets``), the same on both rank sets: the
    whole world, the encoder ranks and the LLM ranks' degrees."""
    names = ("world_size", "dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp")
    out: dict[str, Any] = {n: int(getattr(parallel_dims, n)) for n in names}
    out["sp"] = out.pop("cp")
    sets = getattr(parallel_dims, "rank_sets", None)
    if sets is not None:
        out.update(world_size=len(sets.encoders) + len(sets.llm), dp_shard=len(sets.llm),
                   encoder_ranks=list(sets.encoders))
    return out


def describe_layout(layout: dict | None) -> str:
    """``world 4: dp_shard=2 sp=2`` (degrees of 1 left out)."""
    if not layout:
        return "an unknown layout"
    degrees = " ".join(
        f"{k}={v}" for k, v in sorted(layout.items()) if k != "world_size" and v != 1
    )
    return f"world {layout.get('world_size', '?')}" + (f": {degrees}" if degrees else "")


def _data_rank(parallel_dims) -> tuple[int, int]:
    if parallel_dims.dp_enabled:
        mesh = parallel_dims.get_mesh("batch")
        return mesh.get_local_rank(), mesh.size()
    return 0, 1


def _then(inner: Future, action: Callable[[], None]) -> Future:
    """A future that completes after ``inner`` and then ``action`` did."""
    outer: Future = Future()

    def done(f: Future) -> None:
        try:
            f.result()
            action()
            outer.set_result(None)
        except BaseException as e:  # noqa: BLE001  (surfaced at the next wait, as TorchTitan does)
            logger.error(f"Asynchronous checkpoint save failed: {e}")
            outer.set_exception(e)

    inner.add_done_callback(done)
    return outer


def _tensors(obj: Any, prefix: str, out: dict[str, torch.Tensor]) -> None:
    """DCP's flattened names of the tensors in a (nested dict) state."""
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _tensors(v, f"{prefix}.{k}" if prefix else str(k), out)


def _flattened(states: dict[str, Any]) -> dict[str, Any]:
    """``states`` with the model's state dict in place of the model entry: DCP sees every
    model tensor under its full name, next to the other states."""
    out = {k: v for k, v in states.items() if k != MODEL}
    if MODEL in states:
        out.update(states[MODEL].state_dict())
    return out


class ModelKeys:
    """Names of the model's tensors by role (DCP keys: full FQNs): ``frozen`` (every
    parameter or persistent buffer that does not train) and ``adapters`` (LoRA)."""

    def __init__(self, model_parts: list[torch.nn.Module]) -> None:
        self.frozen: set[str] = set()
        self.adapters: set[str] = set()
        for model in model_parts:
            self.adapters |= adapter_names(model)
            trainable = {n for n, p in model.named_parameters() if p.requires_grad}
            self.frozen |= {n for n in state_tensors(model, adapters=True) if n not in trainable}


class OmniCheckpointManager(TitanCheckpointManager):
    """TorchTitan's ``CheckpointManager`` with the additions in the module docstring."""

    def __init__(self, *, dataloader, model_parts, optimizers, lr_schedulers, states,
                 checkpoint_config, sd_adapter, base_folder: str, parallel_dims,
                 ft_manager=None, adapter_only: bool = False, lora: dict | None = None) -> None:
        # last_save_in_hf / initial_load_in_hf are refused at start-up
        # (torchtitan_omni.config.unsupported).
        self.parallel_dims = parallel_dims
        #: ``lora.save_adapter_only``: saves keep only the trained model tensors (and ``lora``,
        #: the settings and base this run trains with, goes into the manifest)
        self.adapter_only = adapter_only
        self.lora = lora
        self.model_keys = ModelKeys(model_parts)
        self.layout = layout_of(parallel_dims)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        dp_rank, dp_size = _data_rank(parallel_dims)
        wrapped = DataloaderState(dataloader, dp_rank, dp_size) if dataloader is not None else None
        super().__init__(
            dataloader=wrapped, model_parts=model_parts, optimizers=optimizers,
            lr_schedulers=lr_schedulers, states=states, checkpoint_config=checkpoint_config,
            sd_adapter=sd_adapter, base_folder=base_folder, ft_manager=ft_manager,
        )
        self.requested_step = checkpoint_config.load_step
        self._resume: Candidate | None = None
        self._resume_known = False
        if not self.enable:
            return
        if wrapped is None:
            self.states.pop(DATALOADER, None)
        self.states[RNG] = RNGState(self.rank)
        if OPTIMIZER in self.states:
            self.states[OPTIMIZER] = CompleteOptimizerState(self.states[OPTIMIZER])

    # ----------------------------------------------------------------- saving
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode,
                 enable_garbage_collection: bool = False, to_hf: bool = False):
        """Write into ``saving-N.tmp``; rank 0 publishes it as ``step-N`` once complete."""
        if to_hf:
            raise CheckpointFormatError(
                "Hugging Face output goes through scripts/convert_checkpoint.py"
            )
        tmp = tmp_dir(checkpoint_id)
        info = {"step": step_of(checkpoint_id), "model_only": OPTIMIZER not in state_dict,
                "layout": self.layout, "torch": torch.__version__}
        if self.lora is not None:
            info["lora"] = self.lora
        if self.adapter_only:
            frozen = self.model_keys.frozen
            state_dict = {k: v for k, v in state_dict.items() if k not in frozen}
            info["adapter_only"] = True
        result = super().dcp_save(state_dict, tmp, async_mode, enable_garbage_collection)
        if self.rank != 0:
            return result

        def finish(purge: bool) -> None:
            publish(tmp, checkpoint_id, info)
            kind = "model-only" if info["model_only"] else "full"
            logger.info(f"Published {kind} checkpoint {checkpoint_id}")
            if purge:  # TorchTitan purged when the save started, before this one counted
                self.purge_stale_checkpoints()

        if isinstance(result, AsyncSaveResponse):
            return AsyncSaveResponse(result.staging_completion,
                                     _then(result.upload_completion, lambda: finish(True)))
        if isinstance(result, Future):
            return _then(result, lambda: finish(True))
        finish(False)  # a synchronous save has finished on every rank when dcp.save returns
        return result

    def purge_stale_checkpoints(self) -> None:
        """Delete all but the newest ``keep_latest_k`` published checkpoints (rank 0)."""
        if self.keep_latest_k <= 0 or self.rank != 0 or not os.path.isdir(self.folder):
            return
        published = sorted(
            (step_of(os.path.join(self.folder, n)), os.path.join(self.folder, n))
            for n in os.listdir(self.folder) if step_of(os.path.join(self.folder, n)) is not None
        )
        for _, path in published[: -self.keep_latest_k]:
            self.purge_queue.put(path)

    def close(self) -> None:
        """Wait for an in-flight asynchronous save (so it gets published), then close."""
        if getattr(self, "enable", False) and getattr(self, "save_future", None) is not None:
            try:
                self.wait_for_async_save()
            except Exception as e:  # noqa: BLE001  (closing must go on; the error is logged)
                logger.error(f"The last asynchronous checkpoint save did not complete: {e}")
        super().close()

    # ----------------------------------------------------------------- choosing what to load
    def resume_point(self) -> Candidate | None:
        """The checkpoint ``load()`` resumes from: the newest complete full one in the folder
        (a step-0 seed checkpoint counts), the same on every rank. Logs what it skips."""
        if self._resume_known:
            return self._resume
        complete, skipped = scan(self.folder)
        for line in skipped:
            logger.warning(f"Checkpoint folder {self.folder}: skipping {line}")
        usable = []
        for cand in complete:
            if cand.step != 0 and cand.manifest.get("model_only"):
                logger.info(f"Checkpoint folder {self.folder}: skipping step-{cand.step}: "
                            "model only (checkpoint.last_save_model_only), no training state")
            else:
                usable.append(cand)
        chosen = usable[-1] if usable else None
        if chosen is not None and skipped:
            logger.warning(f"Resuming from the last complete checkpoint, step-{chosen.step}")
        elif chosen is None and skipped:
            logger.warning(f"No complete checkpoint to resume from in {self.folder}")
        self._agree(chosen.step if chosen else -1)  # also: every rank has scanned
        if self.rank == 0 and not self.load_only:
            remove_interrupted_saves(self.folder)
        self._resume, self._resume_known = chosen, True
        return chosen

    def _agree(self, step: int) -> None:
        """Fail if the ranks chose different checkpoints (a filesystem not shared by all)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        t = torch.tensor([step, -step], dtype=torch.int64, device=local_device())
        # every process: with non-colocated encoders the world mesh spans one rank set
        hi, neg_lo = (int(v) for v in all_reduce_world(t, op="max"))
        if hi != -neg_lo:
            raise RuntimeError(
                f"ranks disagree on the checkpoint to resume from in {self.folder} (steps "
                f"{-neg_lo} to {hi}; -1 = none): checkpoint.folder must be on a filesystem "
                "that every node sees the same way"
            )

    def holds_base_weights(self, path: str) -> bool:
        """Whether the checkpoint at ``path`` holds the frozen base weights (an adapter-only
        one does not: the base comes from ``weights.sources``)."""
        return not (read_manifest(path) or {}).get("adapter_only")

    def will_load(self) -> str | None:
        """What ``load()`` will load the model from, or None (for ``weights.sources``)."""
        if not self.enable:
            return None
        if self.requested_step != -1:
            return step_dir(self.folder, self.requested_step)
        chosen = self.resume_point()
        if chosen is not None:
            return chosen.path
        return self.initial_load_path or None

    # ----------------------------------------------------------------- loading
    @torch.no_grad()
    def load(self, step: int = -1) -> bool:
        """Resume from ``step`` (-1: the newest complete checkpoint), else load
        ``checkpoint.initial_load_path``; False when there is nothing to load."""
        if not self.enable:
            return False
        if step != -1:
            path = step_dir(self.folder, step)
            problem = verify(path)
            if problem:
                raise CheckpointFormatError(
                    f"checkpoint.load_step={step}: {path} cannot be loaded: {problem}"
                )
            target = Candidate(step, path, read_manifest(path) or {})
            model_only = step == 0 or bool(target.manifest.get("model_only"))
        else:
            target = self.resume_point()
            if target is None:
                if not self.initial_load_path:
                    return False
                path = resolve_checkpoint(self.initial_load_path)
                target = Candidate(step_of(path) or -1, path, read_manifest(path) or {})
                model_only = self.initial_load_model_only
                logger.info(f"Loading {'the model' if model_only else 'the training state'} "
                            f"from checkpoint.initial_load_path {path}")
            else:
                model_only = target.step == 0
        logger.info(f"Loading the checkpoint from {target.path}"
                    + (" (model only)" if model_only else ""))
        begin = time.monotonic()
        states = self._omni_states_to_load(model_only, target)
        self.dcp_load(states, checkpoint_id=target.path, from_hf=False, from_quantized=False)
        logger.info(f"Finished loading the checkpoint in {time.monotonic() - begin:.2f} seconds.")
        return True

    def _omni_states_to_load(self, model_only: bool, target: Candidate) -> dict[str, Any]:
        saved = FileSystemReader(target.path).read_metadata().state_dict_metadata
        if model_only:
            states = self.states[MODEL].state_dict()
        else:
            for key in self.exclude_from_loading:
                if key not in self.states:
                    raise CheckpointFormatError(
                        f"checkpoint.exclude_from_loading names {key!r}; the checkpoint holds "
                        f"{', '.join(sorted(self.states))}"
                    )
            states = {k: v for k, v in self.states.items() if k not in self.exclude_from_loading}
            if DATALOADER in states:
                states[DATALOADER] = states[DATALOADER].for_loading(set(saved), DATALOADER)
            if RNG in states:
                layout = target.manifest.get("layout")
                if layout != self.layout or f"{RNG}.rank_{self.rank}" not in saved:
                    states.pop(RNG)
                    logger.info(
                        f"RNG states not restored: saved under {describe_layout(layout)}, this "
                        f"run is {describe_layout(self.layout)}; every rank keeps its fresh seed"
                    )
            states = _flattened(states)
        states = self._lora_states(states, saved, target, model_only)
        self._check_tensors(states, saved, target.path)
        return states

    def _lora_states(self, states: dict[str, Any], saved: dict, target: Candidate,
                     model_only: bool) -> dict[str, Any]:
        """Model tensors to read from a LoRA-related checkpoint: only the trained ones of an
        adapter-only checkpoint (the base came from ``weights.sources``); the base without
        adapters from a model-only checkpoint that has none (a base model: adapters keep
        their initialization)."""
        adapters = self.model_keys.adapters
        if not adapters and any(is_adapter_key(k) for k in saved if not k.startswith(OPTIMIZER)):
            raise CheckpointFormatError(
                f"{target.path} holds LoRA adapters but this run has none: resume it with the "
                "run's [lora] settings (lora.enable), or export it merged "
                "(scripts/convert_checkpoint.py) and start from that")
        if target.manifest.get("adapter_only"):
            lora = target.manifest.get("lora") or {}
            for key in ("weights_sources", "init_seed"):
                if self.lora is not None and lora.get(key) != self.lora.get(key):
                    logger.warning(
                        f"{target.path} is adapter-only and was trained on a base with "
                        f"{key} = {lora.get(key)!r}; this run has {self.lora.get(key)!r}")
            frozen = self.model_keys.frozen
            return {k: v for k, v in states.items() if k not in frozen}
        if model_only and adapters and not any(k in saved for k in adapters):
            logger.info(f"{target.path} holds no LoRA adapters (a base model): the "
                        f"{len(adapters)} adapter tensors keep their initialization")
            return {k: v for k, v in states.items() if k not in adapters}
        return states

    def _check_tensors(self, states: dict[str, Any], saved: dict, path: str) -> None:
        """Every model/optimizer tensor to load exists in the checkpoint with its shape."""
        tensors: dict[str, torch.Tensor] = {}
        for key, value in states.items():
            if key == OPTIMIZER and isinstance(value, Stateful):
                _tensors(value.state_dict(), OPTIMIZER, tensors)
            elif isinstance(value, torch.Tensor):
                tensors[key] = value
        missing, mismatched = [], []
        for key, t in tensors.items():
            md = saved.get(key)
            if md is None:
                missing.append(key)
            elif isinstance(md, TensorStorageMetadata) and tuple(md.size) != tuple(t.shape):
                mismatched.append(
                    f"{key}: {tuple(md.size)} in the checkpoint, {tuple(t.shape)} here"
                )
        if not (missing or mismatched):
            return
        lines = [f"missing {k}" for k in missing[:_MAX_LISTED]]
        lines += [f"shape mismatch {m}" for m in mismatched[:_MAX_LISTED]]
        hint = ""
        if any(k.startswith(OPTIMIZER) for k in missing):
            hint = (" (an optimizer state that differs, e.g. other frozen parts: pass "
                    "--checkpoint.exclude_from_loading optimizer to start it afresh)")
        raise CheckpointFormatError(
            f"checkpoint {path} does not match this model: {len(missing)} missing and "
            f"{len(mismatched)} mismatched tensors{hint}:\n  " + "\n  ".join(lines)
        )
