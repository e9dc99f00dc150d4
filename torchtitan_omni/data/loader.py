"""``build_omni_dataloader``: TorchTitan's ``build_dataloader_fn`` for omni batches.

The loader yields ``(batch, labels)`` per ``torchtitan_omni.protocols.batch``; it is a
``ParallelAwareDataloader`` (Stateful), so its state, and through it every worker's position
and buffered documents, goes into the checkpoint. ``loader.stats()`` returns the skipped-sample
counters per reason (``torchtitan_omni.data.bad_samples.REASONS``), summed over workers.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict
from typing import Any

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.tools.logging import logger

from torchtitan_omni.data.bad_samples import REASONS
from torchtitan_omni.data.dataset import OmniDataset
from torchtitan_omni.data.default_dataset import DEFAULT_NAME, default_data_dir, maybe_build_default
from torchtitan_omni.data.document import DocumentEncoder
from torchtitan_omni.data.packing import BatchPlan
from torchtitan_omni.data.processors import build_processors
from torchtitan_omni.data.source import RowSource, find_files
from torchtitan_omni.protocols.batch import MODALITIES


class OmniDataLoader(ParallelAwareDataloader):
    """A stateful loader of omni batches that also reports skipped samples (:meth:`stats`)."""

    def __init__(self, dataset: OmniDataset, dp_rank: int, dp_world_size: int, **kwargs) -> None:
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=None,
                         **kwargs)
        self._skipped: dict[int, dict[str, int]] = {}

    def __iter__(self):
        for batch, labels, info in super().__iter__():
            self._skipped[int(info["shard"])] = dict(info["skipped"])
            yield batch, labels

    def stats(self) -> dict[str, int]:
        """Samples skipped so far per reason, over this rank's workers (as of their last batch)."""
        out = dict.fromkeys(REASONS, 0)
        for counts in self._skipped.values():
            for reason, n in counts.items():
                out[reason] = out.get(reason, 0) + int(n)
        return out


def dataset_root(job_config) -> str:
    """The dataset folder (or file) of the job; builds the bundled one if needed."""
    t = job_config.training
    if t.dataset == DEFAULT_NAME:
        maybe_build_default(job_config)
        return default_data_dir(job_config)
    path = t.dataset_path or t.dataset
    if not path or not os.path.exists(path):
        raise FileNotFoundError(
            f"training.dataset={t.dataset!r} with training.dataset_path={t.dataset_path!r}: no "
            f"such file or folder; use '{DEFAULT_NAME}' for the bundled dataset or point "
            "training.dataset_path at JSONL/Parquet files"
        )
    return path


def model_processing(job_config) -> dict[str, Any]:
    """The model's processing config per modality, limited to ``data.modalities``."""
    from torchtitan.protocols.train_spec import get_train_spec

    args = get_train_spec(job_config.model.name).model_args[job_config.model.flavor]
    configs = dict(args.processing()) if hasattr(args, "processing") else {}
    return {m: c for m, c in configs.items() if m in job_config.data.modalities}


def _check_data_config(data, seq_len: int) -> None:
    unknown = set(data.modalities) - set(MODALITIES)
    if unknown:
        raise ValueError(f"data.modalities has unknown {sorted(unknown)} (known: {', '.join(MODALITIES)})")
    if not 0.0 <= data.gen_cfg_drop_prob <= 1.0:
        raise ValueError(f"data.gen_cfg_drop_prob must be in [0, 1], got {data.gen_cfg_drop_prob}")
    if data.token_budget < 0:
        raise ValueError(f"data.token_budget must be >= 0, got {data.token_budget}")
    if data.buffer_docs < 1 or data.pad_multiple < 1:
        raise ValueError("data.buffer_docs and data.pad_multiple must be >= 1")
    if seq_len < 8:
        raise ValueError(f"training.seq_len={seq_len} is too short for any sample")


def build_omni_dataloader(
    dp_world_size: int, dp_rank: int, tokenizer, job_config, *, processing: dict | None = None,
    split: str | None = None, infinite: bool = True, seq_len: int | None = None,
    local_batch_size: int | None = None, **kwargs,
) -> OmniDataLoader:
    """The omni data loader of one data-parallel rank (TorchTitan's ``build_dataloader_fn``).

    ``processing`` overrides the model's processing configs ({modality: config}); ``split``,
    ``seq_len`` and ``local_batch_size`` override the job's (e.g. for validation, with
    ``infinite=False``).
    """
    from torchtitan_omni.data.tokenizer import build_omni_tokenizer

    data = job_config.data
    seq_len = seq_len or job_config.training.seq_len
    rows = local_batch_size or job_config.training.local_batch_size
    _check_data_config(data, seq_len)
    root = dataset_root(job_config)
    if tokenizer is None or not hasattr(tokenizer, "special"):
        tokenizer = build_omni_tokenizer(job_config)
    if processing is None:
        processing = model_processing(job_config)
    processors = build_processors(processing)
    files = find_files(root, split or data.split)
    media_root = root if os.path.isdir(root) else os.path.dirname(root)
    source = RowSource(files, data.format, data.streaming, data.shuffle_seed, data.shuffle)
    encoder = DocumentEncoder(
        tokenizer, processors, seq_len, media_root, mask_prompt_labels=data.mask_prompt_labels,
        gen_cfg_drop_prob=data.gen_cfg_drop_prob, split_long_text=data.split_long_text,
    )
    ulysses = getattr(job_config.parallelism, "ulysses_degree", 1)
    if seq_len % ulysses:
        raise ValueError(f"training.seq_len ({seq_len}) must be a multiple of parallelism.ulysses_degree ({ulysses})")
    plan = BatchPlan(
        seq_len=seq_len, rows=rows, token_budget=data.token_budget, packing=data.packing,
        fixed_length=data.pad_to_fixed_length, multiple=math.lcm(data.pad_multiple, ulysses),
    )
    dataset = OmniDataset(
        source, encoder, plan, dp_rank=dp_rank, dp_world_size=dp_world_size,
        buffer_docs=data.buffer_docs, infinite=infinite, seed=data.shuffle_seed,
        bad_sample_policy=data.bad_sample_policy,
    )
    loader_kwargs = asdict(job_config.training.dataloader)
    loader_kwargs.update(kwargs)
    logger.info(
        f"omni data: {len(files)} file(s) of split {split or data.split!r} under {root}, "
        f"modalities {', '.join(processors) or 'text only'}, rank {dp_rank}/{dp_world_size}"
    )
    return OmniDataLoader(dataset, dp_rank, dp_world_size, **loader_kwargs)
