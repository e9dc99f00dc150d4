"""The omni trainer: TorchTitan's ``Trainer`` for batches of text and media.

Run as ``python -m torchtitan_omni.train --job.config_file CONFIG [--section.key value ...]``
(``run_train.sh`` does, through torchrun). Differences from TorchTitan's trainer:

- the device is CUDA/NCCL or CPU/gloo, chosen at start-up (``torchtitan_omni.platform``);
- the mesh carries Ulysses sequence parallel (``OmniParallelDims``) and each SP rank keeps its
  slice of the batch;
- the model returns one summed loss per head (text, image generation, ...) plus auxiliary
  losses; each is normalized by its global target count and logged on its own;
- throughput counts real (non-padding) tokens, and MFU uses the FLOPs of the actual batches;
- ``[validation]`` runs ``torchtitan_omni.eval.validator.OmniValidator`` (held-out loss per
  named loss and per document modality mix).
- MoE foundations' expert load per layer and dropped token copies are logged
  (``torchtitan_omni.components.moe_metrics``);
- a log step's device values (losses, gradient norm, MoE counts) are copied to the host behind
  its kernels and its line is logged at the end of the next step
  (``components.deferred_read``): the host does not wait for the GPU to finish the step (the
  last step, a validating step and non-colocated encoders log at once);
- non-colocated encoders (``[parallelism.parts."encoders.<name>"] ranks``): each rank set
  gets its own meshes (``distributed.rank_sets``) and share of the model
  (``distributed.split_model``); LLM ranks exchange each micro-batch's media with the encoder
  ranks before the forward (``EncoderClient``), encoder ranks serve them
  (``torchtitan_omni.encoder_ranks``), in the order of ``parallelism.encoder_schedule``
  (``distributed.encoder_schedule``); the gradient norm is the job's on every rank.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, NoReturn

import torchtitan_omni  # noqa: F401  (selects the device before TorchTitan's trainer loads)
import torch
from torch.distributed.elastic.multiprocessing.errors import record

from torchtitan.components.dataloader import DataloaderExhaustedError
from torchtitan.config import JobConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import init_logger, logger
from torchtitan.protocols.train_spec import TrainSpec
from torchtitan.train import Trainer

from torchtitan_omni.checkpoint import (
    drop_titan_checkpointer,
    setup_checkpointing,
    titan_checkpointer_off,
)
from torchtitan_omni.config.manager import parse_job_config_or_exit
from torchtitan_omni.components.inputs import ModelInputs, model_inputs
from torchtitan_omni.components.deferred_read import DeferredRead
from torchtitan_omni.components.metrics import COMPILED_GRAPHS, LogWindow
from torchtitan_omni.components.moe_metrics import MoECounter, moe_metrics
from torchtitan_omni.components.compute_copies import ComputeCopies, keep_expert_compute_copies
from torchtitan_omni.components.expert_weights import (
    NO_SELF_CASTING_EXPERTS,
    store_expert_weights_in,
)
from torchtitan_omni.components.optimizer import (
    clip_gradients_,
    compile_optimizer_updates,
    keep_compute_copies,
    keep_moments_in,
)
from torchtitan_omni.components.quantization import float8_encoders, prepare_float8
from torchtitan_omni.distributed.boundary import balance_metrics
from torchtitan_omni.distributed.compile import compiled_graphs
from torchtitan_omni.distributed.encoder_schedule import run_micro_batches
from torchtitan_omni.distributed.noncolocated import (
    EncoderClient,
    EncoderServer,
    RankSets,
    combine_grad_norms,
    encoder_client,
    share_from_llm,
)
from torchtitan_omni.distributed.parallel_dims import OmniParallelDims
from torchtitan_omni.distributed.rank_sets import (
    RankSetDims,
    agreed_seed,
    encoder_ranks_of,
    rank_set_dims,
)
from torchtitan_omni.distributed.sequence import shard_sequence
from torchtitan_omni.distributed.ulysses import (
    NCCL_HIGH_PRIORITY_ENV, prefer_high_priority_exchanges,
)
from torchtitan_omni.distributed.utils import (
    all_reduce, all_reduce_on_host, reduce_moe_counts,
)
from torchtitan_omni.encoder_ranks import (
    NoBatches,
    encode_under,
    encoder_ranks_spec,
    llm_accumulation_steps,
    serve_encoders,
)
from torchtitan_omni.errors import ConfigError, OmniInputError
from torchtitan_omni.flops import FlopCounter
from torchtitan_omni.modules.host import hold_on_host, to_device
from torchtitan_omni.platform import is_cpu
from torchtitan_omni.protocols import batch as B

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]


@dataclass
class PendingLog:
    """A log step's line waiting for its device values (logged at the end of the next step,
    :meth:`OmniTrainer.flush_log`): the values being copied, the throughput window, the loss
    parts' names (``counted``: those with targets, weighted by the loss; the rest auxiliary),
    the host-side metrics, and the steps the MoE counts cover."""

    step: int
    read: DeferredRead
    window: LogWindow
    part_names: list[str]
    counted: frozenset[str]
    extra: dict[str, Any]
    moe_steps: int


class OmniTrainer(Trainer):
    """TorchTitan's trainer for omni batches (see the module docstring)."""

    def __init__(self, job_config: JobConfig) -> None:
        self._pending_log: PendingLog | None = None
        float8 = prepare_float8(job_config)
        with titan_checkpointer_off(job_config):  # ours replaces it (checkpoint.trainer_setup)
            super().__init__(job_config)
        #: the parameters clipping reads, listed once (walking the model's modules every step
        #: took rank 0's host about 1% of an EP2 MoE step that waits for its host); loading and
        #: the bf16 expert weights below keep these parameter objects
        self._clipped_params = [p for m in self.model_parts for p in m.parameters()]
        if float8:
            where = " and the encoders" if float8_encoders(job_config) else ""
            logger.info(f"Float8 linears in the foundation's blocks{where}; left in bf16: {float8}")
        #: whether the first step still has to log what the compiled optimizer update covered
        self._log_compiled_optimizer = (job_config.compile.enable
                                        and "optimizer" in job_config.compile.components)
        if self._log_compiled_optimizer:
            compile_optimizer_updates(self.optimizers, job_config.compile.backend)
        if job_config.optimizer.moments_dtype != "float32":  # validated: the update compiled
            keep_moments_in(self.optimizers, getattr(torch, job_config.optimizer.moments_dtype))
        dims: OmniParallelDims = self.parallel_dims
        on_encoders = isinstance(dims, RankSetDims) and dims.on_encoders
        if job_config.optimizer.expert_weights_dtype != "float32" and not on_encoders:
            # before any checkpoint manager: TorchTitan's inert one and ours keep the model's
            # state dict from their construction, which would hold (and save) the old weights
            # (the conversion collects garbage first, should a reference cycle hold the manager)
            drop_titan_checkpointer(self)
            self._store_expert_weights(getattr(torch, job_config.optimizer.expert_weights_dtype))
        # Crash-safe, reshardable checkpoints and weights.sources (torchtitan_omni.checkpoint).
        setup_checkpointing(self)
        if is_cpu():
            # TorchTitan autocasts to bf16 when FSDP is off; CPU runs stay in float32.
            self.maybe_enable_amp = contextlib.nullcontext()
            if job_config.validation.enable:
                self.validator.maybe_enable_amp = self.maybe_enable_amp
        self.sp_rank = dims.get_mesh("sp").get_local_rank() if dims.sp_enabled else 0
        #: non-colocated encoders: the rank sets, and this rank's side of the exchange
        self.rank_sets: RankSets | None = None
        self.encoder_client: EncoderClient | None = None
        self.encoder_server: EncoderServer | None = None
        self._encoder_order_logged = False
        if isinstance(dims, RankSetDims):
            self._join_rank_set(dims)
        if self.encoder_server is None:
            self.flop_counter = FlopCounter(self.model_parts[0])
        #: parallelism.expert_compute_copies: the copies until the first step refreshes them
        #: (from then on each optimizer step rewrites them)
        self._copies_to_refresh: ComputeCopies | None = None
        if job_config.parallelism.expert_compute_copies and self.encoder_server is None:
            self._keep_compute_copies()
        logger.info(output_locations(job_config))
        if not is_cpu():  # run_train.sh's default; torchrun without it gets the driver's
            queues = os.environ.get("CUDA_SCALE_LAUNCH_QUEUES") or "the driver's default"
            logger.info(f"CUDA kernel launch queues: {queues} (CUDA_SCALE_LAUNCH_QUEUES)")
        #: routing counts since the last log step, on the device
        self.moe_counter = MoECounter()

    # ----------------------------------------------------------------- set-up
    def _autocast_dtype(self) -> torch.dtype | None:
        # the autocast TorchTitan runs without FSDP; none on CPU, where the experts compute in
        # float32 (see __init__)
        return None if is_cpu() else getattr(self.maybe_enable_amp, "fast_dtype", None)

    def _keep_compute_copies(self) -> None:
        # the copies take the experts' gradients where each expert weight gets one a step (a
        # second would be summed in the compute dtype): one micro-batch, experts run once per
        # layer (the chunked dispatcher runs them per chunk)
        one_gradient = (self.gradient_accumulation_steps == 1
                        and self.job_config.parallelism.expert_dispatch_chunks == 1)
        copies = keep_expert_compute_copies(self.model_parts, self._autocast_dtype(),
                                            gradients=one_gradient)
        if not copies:
            raise ConfigError(f"parallelism.expert_compute_copies: {NO_SELF_CASTING_EXPERTS}; "
                              "leave it off")
        keep_compute_copies(self.optimizers, copies.copies)
        self._copies_to_refresh = copies
        where = ("the copies too, in the compute dtype" if one_gradient else
                 "the weights, in their dtype (several micro-batches a step, or dispatch chunks)")
        logger.info(f"Experts read {copies.numel / 1e6:,.1f}M elements of compute copies "
                    "that the optimizer keeps (parallelism.expert_compute_copies); their "
                    f"gradients go to {where}")

    def _store_expert_weights(self, dtype: torch.dtype) -> None:
        # before any checkpoint or weights load, which then fill the stored dtype
        try:
            numel = store_expert_weights_in(self.model_parts, self._autocast_dtype(), dtype)
        except ValueError as e:
            raise ConfigError(f"optimizer.expert_weights_dtype {str(dtype).split('.')[-1]!r}: "
                              f"{e}; leave it float32") from None
        logger.info(f"Experts store and train {numel / 1e6:,.1f}M weight elements in {dtype} "
                    "(optimizer.expert_weights_dtype): the compiled update rounds them "
                    "stochastically")

    def init_distributed(self) -> OmniParallelDims:
        cfg = self.job_config
        if cfg.parallelism.ulysses_async and cfg.parallelism.ulysses_degree > 1:
            # before the process groups exist: their streams are made with them
            priority = prefer_high_priority_exchanges()
            logger.info(f"Async Ulysses: NCCL streams of high priority: {priority} "
                        f"({NCCL_HIGH_PRIORITY_ENV}; 0 keeps the default)")
        world_size = dist_utils.init_distributed(
            cfg.comm, enable_cpu_backend=cfg.training.enable_cpu_offload,
            base_folder=cfg.job.dump_folder,
        )
        encoder_ranks = encoder_ranks_of(cfg.parallelism)
        if not encoder_ranks:
            return OmniParallelDims.from_config(cfg.parallelism, world_size)
        # TorchTitan agrees on a seed over the world only when its dims span several ranks;
        # a rank set may be one rank, so every rank takes the same seed here
        cfg.debug.seed = agreed_seed(cfg.debug.seed)
        return rank_set_dims(world_size, encoder_ranks)

    @property
    def train_spec(self) -> TrainSpec:
        """The job's train spec; on an encoder rank without tokenizer and data loader
        (``encoder_ranks``), as TorchTitan's ``Trainer.__init__`` reads it."""
        return self._train_spec

    @train_spec.setter
    def train_spec(self, spec: TrainSpec) -> None:
        dims = getattr(self, "parallel_dims", None)
        on_encoders = isinstance(dims, RankSetDims) and dims.on_encoders
        self._train_spec = encoder_ranks_spec(spec) if on_encoders else spec

    def _join_rank_set(self, dims: RankSetDims) -> None:
        """This rank's side of non-colocated encoders: the server on an encoder rank (with
        the LLM ranks' micro-batch count), the stubs' client on an LLM rank."""
        self.rank_sets = dims.rank_sets
        model = self.model_parts[0]
        if dims.on_encoders:
            # under the LLM ranks' forward contexts (read per pass: on CPU the autocast is
            # replaced after TorchTitan's __init__)
            run = encode_under(model, lambda: (self.train_context(), self.maybe_enable_amp))
            self.encoder_server = EncoderServer(dims.rank_sets, model.encoders, self.device,
                                                run=run)
            self.gradient_accumulation_steps = llm_accumulation_steps(
                self.job_config, len(dims.rank_sets.llm))
            self.dataloader = NoBatches()  # after the checkpointer: no data state to keep
            logger.info(f"Encoder rank: serves the LLM ranks' {self.gradient_accumulation_steps} "
                        "micro-batch(es) per step; reads no data")
        else:
            self.encoder_client = encoder_client(model)

    def batch_generator(self, data_iterable: Iterable[Batch]) -> Iterator[Batch]:
        """Yield batches on CPU, counting real tokens and data-loading time."""
        data_iterator = iter(data_iterable)
        while True:
            start = time.perf_counter()
            try:
                batch, labels = next(data_iterator)
            except StopIteration as ex:
                raise DataloaderExhaustedError() from ex
            real = batch.get(B.REAL_TOKENS)
            ntokens = int(real) if real is not None else labels.numel()
            self.ntokens_seen += ntokens
            self.metrics_processor.ntokens_since_last_log += ntokens
            self.metrics_processor.data_loading_times.append(time.perf_counter() - start)
            yield batch, labels

    # ----------------------------------------------------------------- one step
    def forward_backward_step(
        self, *, inputs: ModelInputs,
        global_counts: dict[str, torch.Tensor], aux_contributions: int,
        absent: frozenset[str] = frozenset(), encoder_order: tuple[str, ...] = (),
    ) -> dict[str, torch.Tensor]:
        """Forward and backward of one micro-batch (``inputs``: ``model_inputs``'s, on the
        device); returns each loss part (detached). ``absent``: modalities no rank has in
        this micro-batch (their parts are skipped); ``encoder_order``: the order the encoders
        run in (empty: the model's). Non-colocated encoders: the stubs take the rows the
        exchange before it brought (``encoder_schedule``)."""
        model = self.model_parts[0]
        tokens, meta, labels, media, labelled = inputs
        with self.train_context(), self.maybe_enable_amp:
            out = model(tokens, meta, labels, absent=absent, labelled=labelled,
                        encoder_order=encoder_order, **hold_on_host(media))
            loss, parts = self.loss_fn(out.losses, global_counts, out.aux_losses, aux_contributions)
        self.moe_counter.add(out.moe_counts)
        del out
        loss.backward()
        return {k: v.detach() for k, v in parts.items()}

    def train_step(self, data_iterator: Iterator[Batch]) -> None:
        if self.encoder_server is not None:
            serve_encoders(self, self.encoder_server)
            return
        self.metrics_processor.steps_since_last_log += 1
        self.optimizers.zero_grad()
        if self._copies_to_refresh is not None:
            # the weights as loaded (checkpoint, weights.sources) or initialized
            self._copies_to_refresh.refresh()
            self._copies_to_refresh = None
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        dims: OmniParallelDims = self.parallel_dims
        model = self.model_parts[0]

        microbatches = []
        local_counts: dict[str, torch.Tensor] = defaultdict(
            lambda: torch.zeros((), dtype=torch.long)
        )
        # omni.encoder_order "work": per micro-batch, the FLOPs of its media per modality
        by_work = self.job_config.omni.encoder_order == "work"
        encoder_work: list[dict[str, float]] = []
        for _ in range(self.gradient_accumulation_steps):
            try:
                batch, labels = next(data_iterator)
            except DataloaderExhaustedError:
                self.flush_log()  # the last step's line, before the loop ends
                raise
            self.metrics_processor.flops_since_last_log += self.flop_counter.batch(
                batch[B.CU_SEQLENS], dims.sp, batch=batch, labels=labels
            )
            encoder_work.append(self.flop_counter.encoder_work(batch) if by_work else {})
            batch, labels = shard_sequence(batch, labels, self.sp_rank, dims.sp)
            for name, count in model.count_targets(batch, labels).items():
                local_counts[name] = local_counts[name] + count
            microbatches.append((batch, labels))

        # One all-reduce over every rank (the loss mesh spans data and sequence ranks) gives the
        # loss normalizers and, per micro-batch, which modalities some rank carries. These are
        # host values, summed on the host: a device all-reduce read back here would wait for
        # the previous step's queued kernels and leave the GPU idle while the encoders launch.
        # A log step's skipped-sample counts ride along: a second host all-reduce after the
        # optimizer would be a second point where each host waits for the other's launches.
        loss_mesh = dims.get_optional_mesh("loss")
        names = list(local_counts)
        presence = torch.stack([model.media_present(b) for b, _ in microbatches])
        worked = list(encoder_work[0])
        work = torch.tensor([[int(w[m]) for m in worked] for w in encoder_work],
                            dtype=torch.long)  # FLOPs: integers, exact in int64
        skipped = (self.skipped_sample_counts()
                   if self.metrics_processor.should_log(self.step) else {})
        reasons = sorted(skipped)
        # the ranks of a sequence-parallel group read the same rows: one of them counts
        own = [skipped[r] if self.sp_rank == 0 else 0 for r in reasons]
        local_vec = torch.cat([torch.stack([local_counts[n] for n in names]), presence.flatten(),
                               work.flatten(), torch.tensor(own, dtype=torch.long)])
        global_vec = all_reduce_on_host(local_vec, loss_mesh)
        host_counts = dict(zip(names, global_vec[: len(names)]))
        global_counts = dict(zip(names, to_device(global_vec[: len(names)], self.device)))
        at = len(names) + presence.numel()
        present = global_vec[len(names):at].view(presence.shape)
        total_work = global_vec[at:at + work.numel()].view(work.shape).tolist()
        skipped_total = {f"data/skipped_{r}": int(v)
                         for r, v in zip(reasons, global_vec[at + work.numel():])}
        contributions = self.gradient_accumulation_steps * (loss_mesh.size() if loss_mesh else 1)

        absents = [frozenset(m for m, n in zip(model.modalities, flags) if n == 0)
                   for flags in present.tolist()]
        # the encoders' order per micro-batch, from the work summed over the ranks (the same
        # on every rank; refused with non-colocated encoders, which replay the model's order)
        orders = [model.encoder_order(dict(zip(worked, w))) if by_work else ()
                  for w in total_work]
        if by_work and not self._encoder_order_logged and len(model.encoders) > 1:
            self._encoder_order_logged = True
            logger.info("Encoders run by increasing work of each micro-batch's media "
                        f"(omni.encoder_order = \"work\"); step {self.step}: "
                        f"{', '.join(orders[0])}")
        staged: dict[int, Any] = {}  # micro-batches on the device, from staging to their run

        def media(i: int) -> tuple[dict[str, torch.Tensor], frozenset[str]]:
            # non-colocated encoders: micro-batch i's media out, maybe one run early
            staged[i] = model_inputs(*microbatches[i], self.device)
            return staged[i][3], absents[i]

        def run(i: int) -> dict[str, torch.Tensor]:
            inputs = staged.pop(i) if i in staged else model_inputs(*microbatches[i], self.device)
            return self.forward_backward_step(inputs=inputs, global_counts=global_counts,
                                              aux_contributions=contributions, absent=absents[i],
                                              encoder_order=orders[i])

        sums: dict[str, torch.Tensor] = {}
        for parts in run_micro_batches(self.encoder_client, len(microbatches),
                                       self.job_config.parallelism.encoder_schedule, media, run):
            for name, value in parts.items():
                sums[name] = sums[name] + value if name in sums else value
        self.moe_counter.end_step()

        # non-colocated encoders: the norm of both rank sets' gradients, as colocated
        combine = partial(combine_grad_norms, ranks=self.rank_sets) if self.rank_sets else None
        grad_norm = clip_gradients_(self.optimizers, self._clipped_params,
                                    self.job_config.training.max_norm, combine=combine)
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        if self._log_compiled_optimizer:
            self._log_compiled_optimizer = False
            numel = sum(o.compiled_numel for o in self.optimizers)
            moments = self.job_config.optimizer.moments_dtype
            logger.info(f"Optimizer: {numel / 1e6:,.1f}M of this rank's parameter elements "
                        f"updated by the compiled kernel (moments in {moments}), the rest by "
                        "torch's fused one (moments in their parameters' dtype)")

        # the previous log step's line: its values were copied behind that step's kernels,
        # which the GPU has run by now (or is about to)
        self.flush_log()
        if not self.metrics_processor.should_log(self.step):
            return
        part_names = list(sums)
        local_sums = [sums[n].float() for n in part_names]
        if self.job_config.compile.enable:
            # the graphs every rank has compiled, summed: it grows whenever any rank compiles,
            # and one rank's compile stalls them all at the next collective (the most of any
            # rank stays put while a rank compiles what another already has)
            # (filled on the device: torch.tensor(x, device=...) copies from pageable host
            # memory and makes the host wait for every queued kernel, the step's optimizer too)
            local_sums.append(local_sums[0].new_full((), float(compiled_graphs())))
        # Each part is (local sum / global count): summing over ranks gives the global mean.
        global_sums = all_reduce(torch.stack(local_sums), loss_mesh)
        # Largest per-rank mean of the text loss (TorchTitan's global_max_loss)
        text = "text"
        local_text = sums[text].float() * (
            int(host_counts[text].clamp(min=1)) / int(local_counts[text].clamp(min=1))
        )
        max_loss = all_reduce(local_text.reshape(1), loss_mesh, op="max")
        reads = {"parts": global_sums[:len(part_names)], "max_loss": max_loss,
                 "grad_norm": grad_norm.reshape(1)}
        if len(local_sums) > len(part_names):
            reads["graphs"] = global_sums[len(part_names):]
        counts, moe_steps = self.moe_counter.take()
        if counts is not None:
            reads["moe_loads"], reads["moe_totals"] = reduce_moe_counts(
                counts, dims.get_optional_mesh("ep"), dims.get_optional_mesh("loss"))
        extra = {"n_tokens_seen": self.ntokens_seen, "lr": lr,
                 **{f"targets/{n}": int(c) for n, c in host_counts.items()},
                 **skipped_total,
                 **balance_metrics(getattr(self.model_parts[0], "encoders", {}))}
        read = DeferredRead(reads)
        now = self._log_now()
        if now:
            read.result()  # the window then ends when the step has run, not when it was queued
        self._pending_log = PendingLog(self.step, read,
                                       self.metrics_processor.close_window(read.mark),
                                       part_names, frozenset(global_counts), extra, moe_steps)
        if now:
            self.flush_log()

    def _log_now(self) -> bool:
        """Whether this step's line is logged at once instead of at the end of the next step:
        the last step, a step that validates (its lines follow the step's), and non-colocated
        encoders (their ranks log the same line in the same step)."""
        job = self.job_config
        return (self.step >= job.training.steps or self.rank_sets is not None
                or (job.validation.enable and self.validator.should_validate(self.step)))

    def flush_log(self) -> None:
        """Log the pending log step's line (:class:`PendingLog`), if any."""
        pending, self._pending_log = self._pending_log, None
        if pending is None:
            return
        values = pending.read.result()
        losses = {n: float(v) for n, v in zip(pending.part_names, values["parts"])}
        total = sum(
            (self.loss_fn.weight(n) if n in pending.counted else self.loss_fn.aux_weight) * v
            for n, v in losses.items()
        )
        max_loss, grad_norm = float(values["max_loss"][0]), float(values["grad_norm"][0])
        extra = dict(pending.extra)
        if "graphs" in values:  # summed over the ranks (stops growing after warm-up)
            extra[COMPILED_GRAPHS] = int(values["graphs"][0])
        if "moe_loads" in values:
            totals = values["moe_totals"]
            extra.update(moe_metrics(values["moe_loads"], totals[0], totals[1], pending.moe_steps))
        if self.rank_sets is not None:
            # the encoder ranks log this line too (encoder_ranks.log_shared_line)
            share_from_llm(self.log_line(pending.step, total, max_loss, losses, grad_norm, extra,
                                         pending.window), self.rank_sets)
        self.metrics_processor.log_losses(pending.step, total, max_loss, losses, grad_norm,
                                          extra_metrics=extra, window=pending.window)
        self.on_line_logged(pending.step, losses, self.metrics_processor.last_metrics)

    def on_line_logged(self, step: int, losses: dict[str, float],
                       metrics: dict[str, Any]) -> None:
        """Called after each training log line with its step, named losses and every metric
        logged (a step's line comes at the end of the next step, or at once: ``flush_log``).
        Does nothing; a subclass records lines here (tests, custom loggers)."""

    def log_line(self, step: int, total: float, max_loss: float, losses: dict[str, float],
                 grad_norm: float, extra: dict[str, Any], window: LogWindow) -> dict[str, Any]:
        """A step's log line as the encoder ranks take it."""
        return {"step": step, "total": total, "max_loss": max_loss, "losses": losses,
                "grad_norm": grad_norm, "extra": extra, "ntokens": window.ntokens,
                "flops": window.flops, "steps": window.steps}

    def close(self) -> None:
        """Log a line still pending (a run that stopped between log steps), then close."""
        try:
            self.flush_log()
        except RuntimeError as e:  # the run failed: its error is what the user needs to see
            logger.warning(f"The last pending log line could not be read: {e}")
        super().close()

    def skipped_sample_counts(self) -> dict[str, int]:
        """Samples this rank's data pipeline skipped so far, per reason (every reason, zeros
        included: each rank sums the same list); the log step's line has them summed over
        the data ranks (``data/skipped_<reason>``). Empty for a loader without ``stats``."""
        stats = getattr(self.dataloader, "stats", None)
        return dict(stats()) if stats is not None else {}


def output_locations(job_config: JobConfig) -> str:
    """One line saying where this job writes its TensorBoard events and checkpoints."""
    dump = job_config.job.dump_folder
    m, c = job_config.metrics, job_config.checkpoint
    tb = (os.path.join(dump, m.save_tb_folder, "<date-time>") if m.enable_tensorboard
          else "off (--metrics.enable_tensorboard)")
    ckpt = os.path.join(dump, c.folder) if c.enable else "off (--checkpoint.enable)"
    return f"Outputs of this job: TensorBoard {tb}; checkpoints {ckpt}; log on the console"


def _record_for_launcher(line: str) -> None:
    """Give torchrun's failure summary this rank's one-line error (its output may be filtered
    out by LOG_RANK): the error file torchelastic names in ``TORCHELASTIC_ERROR_FILE``, in its
    documented format, with the line in place of a traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    info = {"py_callstack": line, "timestamp": str(int(time.time()))}
    with open(path, "w") as f:
        json.dump({"message": {"message": line, "extraInfo": info}}, f)


@record
def main(argv: list[str] | None = None, trainer_cls: type[OmniTrainer] | None = None) -> None:
    """Train (or write the seed checkpoint) with ``trainer_cls`` (default :class:`OmniTrainer`)
    on ``argv`` (default: the command line), then close the trainer and the process groups."""
    init_logger()
    # the line reaches torchrun's summary too: without the launcher's pre-check
    # (TORCHTITAN_OMNI_PRECHECK=0) a rank whose output is not shown may be the one to report it
    config = parse_job_config_or_exit(argv, report=_record_for_launcher)
    trainer: OmniTrainer | None = None
    try:
        trainer = (trainer_cls or OmniTrainer)(config)
        if config.checkpoint.create_seed_checkpoint:
            # checkpoint.enable and a single process were checked at start-up
            trainer.checkpointer.save(curr_step=0, last_step=True)
        else:
            trainer.train()
    except (OmniInputError, FileNotFoundError) as e:
        # Bad input (data, checkpoint, weights): the message names it; no traceback. The
        # launcher's failure summary names it too (a rank whose output is not shown may be the
        # one that failed).
        logger.error(f"torchtitan-omni: {e}")
        print(f"torchtitan-omni: error: {e}", file=sys.stderr)
        _record_for_launcher(f"torchtitan-omni: error: {e}")
        sys.exit(1)
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def exit_without_finalization(code: int = 0) -> NoReturn:
    """End the process after an orderly shutdown, skipping the interpreter's finalization.

    Why: gloo's worker and socket threads live until the last reference to their process
    group goes, and torch's DTensor caches (redistribution plans) keep device meshes, hence
    their groups, alive after ``destroy_process_group()``; those threads then run on while the
    interpreter tears itself down, the situation in which a CPU rank was seen to abort
    (SIGABRT) right after its last step. By this point the trainer is closed (checkpoints
    written, metric writers closed) and the process groups destroyed; what is left is freed
    while the interpreter is whole (data-loader workers shut down with their loader), and the
    log handlers and standard streams are flushed."""
    gc.collect()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def run_cli(trainer_cls: type[OmniTrainer] | None = None) -> NoReturn:
    """``python -m torchtitan_omni.train``: :func:`main` on the command line, then
    :func:`exit_without_finalization` with its exit status (an error's too)."""
    try:
        main(trainer_cls=trainer_cls)
    except SystemExit as e:  # the one-line errors of bad input
        if isinstance(e.code, str):  # what the interpreter would print on its way out
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        exit_without_finalization(code)
    exit_without_finalization(0)


if __name__ == "__main__":
    run_cli()
