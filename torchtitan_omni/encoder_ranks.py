"""What ``OmniTrainer`` does differently on the encoder ranks of non-colocated encoders.

The encoder ranks (``[parallelism.parts."encoders.<name>"] ranks``) hold only the encoders
(``distributed.split_model.EncoderRanksModel``) and read no data. TorchTitan's
``Trainer.__init__`` builds their optimizer, LR scheduler, metrics and checkpoint manager
as on any rank, from a train spec without tokenizer and data loader, whose validator serves
the LLM ranks' validation (:func:`encoder_ranks_spec`). Each step they serve the LLM ranks'
micro-batches (:func:`serve_encoders`): as many as the LLM ranks run, in the order of
``parallelism.encoder_schedule`` (``distributed.encoder_schedule``), then the clip by the
job's gradient norm, the optimizer and scheduler steps, and the LLM ranks' log line, which
the encoder ranks log too (the default ``LOG_RANK=0`` shows rank 0, which may be an encoder
rank). Validation likewise (:class:`EncoderRanksValidator`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, nullcontext
from functools import partial
from typing import Any, cast

import torch
import torch.nn as nn

from torchtitan.components.validate import BaseValidator
from torchtitan.config import JobConfig
from torchtitan.protocols.train_spec import TrainSpec

from torchtitan_omni.components.optimizer import clip_gradients_
from torchtitan_omni.distributed.encoder_schedule import serve_micro_batches
from torchtitan_omni.distributed.noncolocated import (
    EncoderServer,
    RankSets,
    combine_grad_norms,
    share_from_llm,
)
from torchtitan_omni.eval.validator import log_validation, validates_at
from torchtitan_omni.platform import local_device


def encoder_ranks_spec(spec: TrainSpec) -> TrainSpec:
    """``spec`` without tokenizer and data loader, with :class:`EncoderRanksValidator`: what
    TorchTitan's ``Trainer.__init__`` builds on an encoder rank."""
    return dataclasses.replace(spec, build_tokenizer_fn=None,  # type: ignore[arg-type]
                               build_dataloader_fn=None,
                               build_validator_fn=build_encoder_ranks_validator)


class EncoderRanksValidator(BaseValidator):
    """Validation on an encoder rank: at the LLM ranks' validation steps
    (``validation.freq``), encode their held-out batches' media forward only, with the
    encoders in eval mode, until they are through (``EncoderServer.serve_forward``), then
    log the LLM ranks' metrics (``OmniValidator`` shares them)."""

    def __init__(self, job_config: JobConfig, ranks: RankSets, metrics_processor: Any,
                 validation_context: Callable[[], AbstractContextManager] = nullcontext,
                 maybe_enable_amp: AbstractContextManager | None = None) -> None:
        super().__init__(job_config)
        self.ranks = ranks
        self.metrics_processor = metrics_processor
        # the LLM ranks' validation forward runs under these (OmniValidator); the trainer
        # replaces the autocast on CPU after building the validator, so it is read per pass
        self.validation_context = validation_context
        self.maybe_enable_amp = maybe_enable_amp or nullcontext()
        self.last_metrics: dict[str, float] = {}
        #: forwards served in the last validation (the LLM ranks' batch count)
        self.last_served = 0

    def should_validate(self, step: int) -> bool:
        """The LLM ranks' rule (``OmniValidator.should_validate``)."""
        return validates_at(self.job_config, step)

    def encoder_run(self, model: nn.Module
                    ) -> Callable[[str, dict[str, torch.Tensor], str], torch.Tensor]:
        """The server's ``run``: ``model`` under the validation context and autocast."""
        return encode_under(model, lambda: (self.validation_context(), self.maybe_enable_amp))

    def validate(self, model_parts: list[nn.Module], step: int) -> dict[str, float]:
        """Serve one validation of the LLM ranks; log and return their metrics."""
        start = time.perf_counter()
        model = model_parts[0]
        server = EncoderServer(self.ranks, cast(Any, model).encoders, local_device(),
                               run=self.encoder_run(model))
        for m in model_parts:
            m.eval()
        try:
            self.last_served = server.serve_forward()
        finally:
            for m in model_parts:
                m.train()
        metrics = share_from_llm(None, self.ranks)
        log_validation(self.metrics_processor, step, metrics)
        self.metrics_processor.time_last_log += time.perf_counter() - start
        self.last_metrics = metrics
        return metrics


def build_encoder_ranks_validator(job_config: JobConfig, parallel_dims: Any,
                                  metrics_processor: Any = None,
                                  validation_context: Callable[[], AbstractContextManager]
                                  = nullcontext,
                                  maybe_enable_amp: AbstractContextManager | None = None,
                                  **kwargs: Any) -> EncoderRanksValidator:
    """``TrainSpec.build_validator_fn`` of the encoder ranks (TorchTitan's keywords; the
    tokenizer and data ones are the LLM ranks' business)."""
    del kwargs
    return EncoderRanksValidator(job_config, parallel_dims.rank_sets, metrics_processor,
                                 validation_context, maybe_enable_amp)


def llm_accumulation_steps(job_config: JobConfig, llm_data_ranks: int) -> int:
    """The micro-batches per step of the LLM ranks (TorchTitan's rule for their degree)."""
    t = job_config.training
    if t.global_batch_size < 0:
        return 1
    return t.global_batch_size // (t.local_batch_size * llm_data_ranks)


class NoBatches:
    """The encoder ranks' stand-in for a data loader: they read no data, but TorchTitan's
    ``Trainer.train`` asks for a loader before its loop (and iterates it only through
    ``train_step``, which never does on these ranks)."""

    def __iter__(self) -> Iterator[Any]:
        raise RuntimeError("encoder ranks read no data (non-colocated encoders)")


def encode_under(model: nn.Module, contexts: Callable[[], tuple[AbstractContextManager, ...]]
                 ) -> Callable[[str, dict[str, torch.Tensor], str], torch.Tensor]:
    """``EncoderServer``'s ``run`` on an encoder rank: ``model`` (``EncoderRanksModel``)
    under ``contexts()`` (called per pass: the train or validation context and TorchTitan's
    autocast, as the LLM ranks' forward runs under them). An encoder set of one rank has no
    FSDP and so no mixed-precision policy: without the autocast it computed in float32
    (measured 4.5x slower on 4x H200)."""
    def encode(name: str, media: dict[str, torch.Tensor], modality: str) -> torch.Tensor:
        with ExitStack() as stack:
            for context in contexts():
                stack.enter_context(context)
            return model(name, media, modality)

    return encode


def serve_encoders(trainer: Any, server: EncoderServer) -> None:
    """One training step of an encoder rank (see the module docstring)."""
    trainer.optimizers.zero_grad()
    lr = trainer.lr_schedulers.schedulers[0].get_last_lr()[0]
    server.events.clear()
    serve_micro_batches(server, trainer.gradient_accumulation_steps,
                        trainer.job_config.parallelism.encoder_schedule)
    params = [p for m in trainer.model_parts for p in m.parameters()]
    clip_gradients_(trainer.optimizers, params, trainer.job_config.training.max_norm,
                    combine=partial(combine_grad_norms, ranks=server.ranks))
    trainer.checkpointer.maybe_wait_for_staging()
    trainer.optimizers.step()
    trainer.lr_schedulers.step()
    if trainer.metrics_processor.should_log(trainer.step):
        log_shared_line(trainer, share_from_llm(None, server.ranks), lr)


def log_shared_line(trainer: Any, line: dict[str, Any], lr: float) -> None:
    """Log the LLM ranks' step ``line`` (``OmniTrainer.log_line``) on an encoder rank, with
    its own memory and the LLM ranks' throughput."""
    metrics = trainer.metrics_processor
    metrics.ntokens_since_last_log = line["ntokens"]
    metrics.flops_since_last_log = line["flops"]
    metrics.steps_since_last_log = line["steps"]
    trainer.ntokens_seen = line["extra"].get("n_tokens_seen", trainer.ntokens_seen)
    metrics.log_losses(line["step"], line["total"], line["max_loss"], line["losses"],
                       line["grad_norm"], extra_metrics={**line["extra"], "lr": lr})
    trainer.on_line_logged(line["step"], line["losses"], metrics.last_metrics)
