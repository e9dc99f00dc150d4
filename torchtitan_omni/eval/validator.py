"""In-training validation: the held-out loss per named loss and per document modality mix.

TorchTitan's trainer calls ``validator.validate(model_parts, step)`` after each step for which
``should_validate(step)`` holds (``step % validation.freq == 0``). The omni validator then:

- rewinds its loader to the start of the held-out split, so every validation scores the same
  batches (and the training loader, a different object, never moves);
- runs ``validation.steps`` batches (``-1``: the whole split once) under ``no_grad`` with the
  model in eval mode, each SP rank on its slice of the sequence;
- per batch, makes one all-reduce over the data and sequence ranks of: whether the rank still
  has a batch, which modalities it carries, and its target counts per loss and per mix. Ranks
  through the split forward an all-padding batch while others still have data, and modalities
  no rank carries are skipped everywhere, so every rank makes the same collectives;
- divides each summed loss by its global target count (as training normalizes), and logs
  ``validation/loss`` (weighted like training), ``validation/loss/<name>`` and
  ``validation/mix/<mix>`` (the text loss of the targets in documents of that mix, see
  ``torchtitan_omni.eval.mix``) to the console and TensorBoard.

With non-colocated encoders the LLM ranks run this validator, exchanging each batch's media
with the encoder ranks before its forward (``EncoderClient.exchange``, here under
``no_grad``) and telling them when the batches are through (``EncoderClient.stop``); the
encoder ranks serve that many forwards and log the LLM ranks' metrics
(``torchtitan_omni.encoder_ranks.EncoderRanksValidator``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from torchtitan.components.validate import BaseValidator
from torchtitan.tools.logging import logger

from torchtitan_omni.components.inputs import model_inputs
from torchtitan_omni.errors import ConfigError
from torchtitan_omni.data.default_dataset import DEFAULT_NAME
from torchtitan_omni.data.loader import build_omni_dataloader, resolved_loader_options
from torchtitan_omni.distributed.noncolocated import encoder_client, share_from_llm
from torchtitan_omni.distributed.sequence import shard_sequence
from torchtitan_omni.distributed.utils import all_reduce_on_host
from torchtitan_omni.eval.mix import document_mix, mix_name
from torchtitan_omni.modules.host import hold_on_host
from torchtitan_omni.platform import local_device
from torchtitan_omni.protocols import batch as B

#: TorchTitan's default ``validation.dataset``: taken to mean "the training dataset"
TORCHTITAN_DEFAULT_DATASET = "c4_validation"
PREFIX = "validation"
#: dataset name of a ``validation.dataset_path`` given next to the bundled training set
HELD_OUT = "held_out"


def validation_dataset(job_config) -> tuple[str, str | None]:
    """``(dataset, dataset_path)`` the validator reads (see ``config.job_config.Validation``)."""
    v, t = job_config.validation, job_config.training
    name = t.dataset if v.dataset in (TORCHTITAN_DEFAULT_DATASET, "") else v.dataset
    if not v.dataset_path:
        return name, (t.dataset_path if name == t.dataset else None)
    if name == DEFAULT_NAME and v.dataset != DEFAULT_NAME:
        # a held-out path next to the bundled training set: plain files, never (re)built
        return HELD_OUT, v.dataset_path
    return name, v.dataset_path


def validation_problem(job_config, ulysses_degree: int = 1, check_data: bool = True
                       ) -> str | None:
    """The first impossible ``[validation]`` value as one line, or None (also fit for the
    start-up config check). ``check_data``: also that the validation dataset exists (for
    specs that read data through the omni loader)."""
    v = job_config.validation
    if not v.enable:
        return None
    if v.freq < 1:
        return f"validation.freq must be >= 1, got {v.freq}"
    if v.steps != -1 and v.steps < 1:
        return f"validation.steps must be >= 1 or -1 (the whole split), got {v.steps}"
    if v.local_batch_size < 1:
        return f"validation.local_batch_size must be >= 1, got {v.local_batch_size}"
    if v.seq_len < 8 or v.seq_len % ulysses_degree:
        return (f"validation.seq_len ({v.seq_len}) must be >= 8 and a multiple of "
                f"parallelism.ulysses_degree ({ulysses_degree})")
    dataset, path = validation_dataset(job_config)
    if check_data and dataset != DEFAULT_NAME and not os.path.exists(path or dataset):
        return (f"validation.dataset_path {path!r} does not exist (validation.dataset="
                f"{v.dataset!r}, training.dataset={job_config.training.dataset!r})")
    return None


def validation_job_config(job_config):
    """A copy of ``job_config`` whose ``training.dataset``/``dataset_path`` name the
    validation data, for the data loader builder (which reads those keys)."""
    dataset, path = validation_dataset(job_config)
    t = job_config.training
    if (dataset, path) == (t.dataset, t.dataset_path):
        return job_config
    return replace(job_config, training=replace(t, dataset=dataset, dataset_path=path))


class OmniValidator(BaseValidator):
    """Held-out losses of an omni model during training (see the module docstring)."""

    def __init__(self, job_config, loader, loss_fn, parallel_dims, validation_context: Callable,
                 maybe_enable_amp, metrics_processor, pad_id: int = 0) -> None:
        super().__init__(job_config)
        self.loader = loader
        self.loss_fn = loss_fn
        self.parallel_dims = parallel_dims
        self.validation_context = validation_context
        self.maybe_enable_amp = maybe_enable_amp
        self.metrics_processor = metrics_processor
        self.pad_id = pad_id
        self.device = local_device()
        dims = parallel_dims
        self.sp = dims.sp if dims.sp_enabled else 1
        self.sp_rank = dims.get_mesh("sp").get_local_rank() if dims.sp_enabled else 0
        self.loss_mesh = dims.get_optional_mesh("loss")
        # Every validation starts from here: the same held-out batches each time.
        self._start = loader.state_dict()
        self.last_metrics: dict[str, float] = {}

    def should_validate(self, step: int) -> bool:
        """Exactly every ``validation.freq`` steps (TorchTitan's default also adds step 1)."""
        return validates_at(self.job_config, step)

    def _padding_batch(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """One row of padding without targets: the forward of a rank that is through the split
        while others are not (it adds nothing to any sum or count)."""
        length = math.lcm(8, self.sp)
        batch = {
            B.INPUT: torch.full((1, length), self.pad_id, dtype=torch.long),
            B.POSITION_IDS: torch.arange(length).unsqueeze(0),
            B.CU_SEQLENS: torch.tensor([0, length], dtype=torch.int32),
            B.REAL_TOKENS: torch.tensor(0),
        }
        return batch, torch.full((1, length), B.IGNORE_INDEX, dtype=torch.long)

    @torch.no_grad()
    def validate(self, model_parts: list[torch.nn.Module], step: int) -> dict[str, float]:
        """Score the held-out batches, log them at ``step``, and return the logged metrics."""
        start = time.perf_counter()
        for m in model_parts:
            m.eval()
        try:
            metrics = self._run(model_parts[0])
        finally:
            for m in model_parts:
                m.train()
        elapsed = time.perf_counter() - start
        metrics[f"{PREFIX}/time(s)"] = elapsed
        client = encoder_client(model_parts[0])
        if client is not None:  # the encoder ranks log them too (EncoderRanksValidator)
            share_from_llm(metrics, client.ranks)
        log_validation(self.metrics_processor, step, metrics)
        # validation time is not training time: keep it out of the next throughput figure
        self.metrics_processor.time_last_log += elapsed
        self.last_metrics = metrics
        return metrics

    def _run(self, model) -> dict[str, float]:
        steps = self.job_config.validation.steps
        modalities = tuple(model.modalities)
        loss_names = tuple(model.loss_names())
        n_mix = 1 << len(modalities)
        counts = torch.zeros(len(loss_names), dtype=torch.long)
        mix_counts = torch.zeros(n_mix, dtype=torch.long)
        sums = torch.zeros(len(loss_names), dtype=torch.float64)
        mix_sums = torch.zeros(n_mix, dtype=torch.float64)
        aux_sums: dict[str, float] = {}
        real_batches = forwards = 0

        client = encoder_client(model)  # non-colocated encoders: the LLM ranks' side
        self.loader.load_state_dict(self._start)
        batches = iter(self.loader)
        while steps == -1 or forwards < steps:
            item = next(batches, None)
            has_batch = item is not None
            batch, labels = item if has_batch else self._padding_batch()
            mix = document_mix(batch, labels, modalities)
            batch, labels = shard_sequence(batch, labels, self.sp_rank, self.sp)
            _, mix = shard_sequence({}, mix, self.sp_rank, self.sp)
            local = model.count_targets(batch, labels)
            per_mix = torch.bincount(mix[labels != B.IGNORE_INDEX], minlength=n_mix)
            vec = torch.cat([
                torch.tensor([int(has_batch)]), model.media_present(batch),
                torch.stack([local[n].reshape(()).long().cpu() for n in loss_names]), per_mix,
            ])
            agreed = all_reduce_on_host(vec, self.loss_mesh)
            if int(agreed[0]) == 0:
                break  # every rank is through the split
            flags = agreed[1:1 + len(modalities)].tolist()
            counts += agreed[1 + len(modalities):1 + len(modalities) + len(loss_names)]
            batch_mix = agreed[1 + len(modalities) + len(loss_names):]
            mix_counts += batch_mix
            absent = frozenset(m for m, f in zip(modalities, flags) if f == 0)
            groups = [g for g in range(n_mix) if batch_mix[g] > 0]
            tokens, meta, labels, media, _ = model_inputs(batch, labels, self.device)
            if client is not None:
                client.exchange(media, absent)
            with self.validation_context(), self.maybe_enable_amp:
                out = model(tokens, meta, labels, absent=absent, label_groups=mix.to(self.device),
                            groups=groups, **hold_on_host(media))
            forwards += 1
            for name in out.aux_losses:
                aux_sums.setdefault(name, 0.0)
            if not has_batch:
                continue
            real_batches += 1
            for i, name in enumerate(loss_names):
                sums[i] += float(out.losses[name])
            for g, value in out.text_by_group.items():
                mix_sums[g] += float(value)
            for name, value in out.aux_losses.items():
                aux_sums[name] += float(value)

        if client is not None:
            client.stop()  # as many forwards on the encoder ranks as here
        aux_names = sorted(aux_sums)
        local_vec = torch.cat([sums, mix_sums, torch.tensor([aux_sums[n] for n in aux_names],
                                                            dtype=torch.float64),
                               torch.tensor([float(real_batches)], dtype=torch.float64)])
        total_vec = all_reduce_on_host(local_vec, self.loss_mesh)
        g_sums = total_vec[:len(loss_names)]
        g_mix = total_vec[len(loss_names):len(loss_names) + n_mix]
        g_aux = total_vec[len(loss_names) + n_mix:-1]
        g_batches = float(total_vec[-1])

        losses = {n: float(g_sums[i] / counts[i])
                  for i, n in enumerate(loss_names) if counts[i] > 0}
        if g_batches > 0:
            # auxiliary losses are per-rank means: average them over (rank, batch)
            losses.update({n: float(g_aux[i]) / g_batches for i, n in enumerate(aux_names)})
        total = sum(self._weight(n, n in aux_names) * v for n, v in losses.items())
        metrics = {f"{PREFIX}/loss": total} if losses else {}
        metrics.update({f"{PREFIX}/loss/{n}": v for n, v in losses.items()})
        for g in range(n_mix):
            if mix_counts[g] > 0:
                metrics[f"{PREFIX}/mix/{mix_name(g, modalities)}"] = float(g_mix[g] / mix_counts[g])
        metrics.update({f"{PREFIX}/targets/{n}": int(counts[i])
                        for i, n in enumerate(loss_names)})
        metrics[f"{PREFIX}/batches"] = forwards
        return metrics

    def _weight(self, name: str, aux: bool) -> float:
        if aux:
            return float(getattr(self.loss_fn, "aux_weight", 1.0))
        weight = getattr(self.loss_fn, "weight", None)
        return float(weight(name)) if callable(weight) else 1.0

def validates_at(job_config, step: int) -> bool:
    """Whether a validation follows ``step``: exactly every ``validation.freq`` steps."""
    return step % job_config.validation.freq == 0


def log_validation(metrics_processor, step: int, metrics: dict[str, float]) -> None:
    """One validation's ``metrics`` to TensorBoard/W&B and the console line."""
    metrics_processor.logger.log(metrics, step)
    losses = "  ".join(f"{k.split('/', 2)[2]}: {v:.5f}" for k, v in metrics.items()
                       if k.startswith(f"{PREFIX}/loss/"))
    mixes = "  ".join(f"{k.split('/', 2)[2]}: {v:.5f}" for k, v in metrics.items()
                      if k.startswith(f"{PREFIX}/mix/"))
    if f"{PREFIX}/loss" not in metrics:
        logger.warning(f"validate step: {step:2}  the held-out split gave no targets")
        return
    logger.info(
        f"validate step: {step:2}  loss: {metrics[f'{PREFIX}/loss']:8.5f} ({losses})  "
        f"by mix: ({mixes})  batches: {metrics[f'{PREFIX}/batches']}  "
        f"time: {metrics[f'{PREFIX}/time(s)']:.1f}s"
    )


def build_omni_validator(
    job_config, dp_world_size: int, dp_rank: int, tokenizer, parallel_dims, loss_fn,
    validation_context: Callable, maybe_enable_amp, metrics_processor=None,
    pp_schedule=None, pp_has_first_stage=None, pp_has_last_stage=None, *,
    build_dataloader_fn: Callable | None = None, **kwargs: Any,
) -> OmniValidator:
    """``TrainSpec.build_validator_fn``: an :class:`OmniValidator` on the held-out split of
    ``[validation]`` (one-line :class:`ConfigError` for an impossible value).

    ``build_dataloader_fn`` (default: the omni loader) is called with ``split``, ``infinite``,
    ``seq_len`` and ``local_batch_size`` keywords."""
    del pp_schedule, pp_has_first_stage, pp_has_last_stage, kwargs  # no pipeline parallelism

    if metrics_processor is None:
        raise ValueError("the omni validator needs the trainer's metrics processor")
    sp = parallel_dims.sp if parallel_dims.sp_enabled else 1
    build = build_dataloader_fn or build_omni_dataloader
    problem = validation_problem(job_config, sp, check_data=build is build_omni_dataloader)
    if problem:
        raise ConfigError(problem)
    v = job_config.validation
    loader = build(
        dp_world_size, dp_rank, tokenizer, validation_job_config(job_config), split=v.split,
        infinite=v.steps != -1, seq_len=v.seq_len, local_batch_size=v.local_batch_size,
        **resolved_loader_options(v.dataloader),
    )
    special = getattr(tokenizer, "special", None)
    return OmniValidator(
        job_config, loader, loss_fn, parallel_dims, validation_context, maybe_enable_amp,
        metrics_processor, pad_id=int(getattr(special, "pad", 0) or 0),
    )
