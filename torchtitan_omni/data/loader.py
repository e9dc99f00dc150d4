"""``build_omni_dataloader``: TorchTitan's ``build_dataloader_fn`` for omni batches.

The loader yields ``(batch, labels)`` per ``torchtitan_omni.protocols.batch``; it is a
``ParallelAwareDataloader`` (Stateful), so its state, and through it every worker's position
and buffered documents, goes into the checkpoint. ``loader.stats()`` returns the skipped-sample
counters per reason (``torchtitan_omni.data.bad_samples.REASONS``), summed over workers.
``loader.load_state_dict_resharded(states)`` continues the stream of a checkpoint written by
another number of data-parallel ranks (or loader workers), see ``torchtitan_omni.data.resplit``.
"""

from __future__ import annotations

import math
import os
import pickle
from dataclasses import asdict
from typing import Any

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.tools.logging import logger

from torchtitan_omni.compat import (
    loader_dataset_states,
    loader_state_key,
    loader_state_key_of_rank,
    loader_steps_since_snapshot,
    loader_worker_count,
    restart_loader_from_dataset,
)
from torchtitan_omni.data.bad_samples import REASONS
from torchtitan_omni.data.dataset import OmniDataset
from torchtitan_omni.data.default_dataset import DEFAULT_NAME, default_data_dir, maybe_build_default
from torchtitan_omni.data.document import DocumentEncoder
from torchtitan_omni.data.packing import BatchPlan
from torchtitan_omni.data.processors import build_processors
from torchtitan_omni.data.source import RowSource, find_files
from torchtitan_omni.data.tokenizer import build_omni_tokenizer
from torchtitan_omni.errors import OmniInputError
from torchtitan_omni.job_model import job_model_args
from torchtitan_omni.platform import is_cpu
from torchtitan_omni.protocols.modality import ALL_MODALITIES, modality_names


class OmniDataLoader(ParallelAwareDataloader):
    """A stateful loader of omni batches that also reports skipped samples (:meth:`stats`)."""

    def __init__(self, dataset: OmniDataset, dp_rank: int, dp_world_size: int, **kwargs) -> None:
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=None,
                         **kwargs)
        self._skipped: dict[int, dict[str, int]] = {}

    def __iter__(self):
        try:
            for batch, labels, info in super().__iter__():
                self._skipped[int(info["shard"])] = dict(info["skipped"])
                yield batch, labels
        except GeneratorExit:
            raise  # closed (also at interpreter exit, when module globals are gone)
        except OmniInputError as e:
            raise one_line(e) from None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """This rank's own state (same data ranks and loader workers as when it was saved)."""
        entry = state_dict.get(loader_state_key(self)) if state_dict else None
        if entry is not None:
            inner = pickle.loads(entry) if isinstance(entry, bytes) else entry
            workers = loader_worker_count(inner)
            if workers != self.num_workers:
                raise ValueError(
                    f"the dataloader state was saved with {workers} loader workers per data rank, "
                    f"this run has training.dataloader.num_workers = {self.num_workers}: keep the "
                    "number of loader workers when the data-parallel size stays the same, or "
                    "pass --checkpoint.exclude_from_loading dataloader to restart the data stream"
                )
        super().load_state_dict(state_dict)

    def load_state_dict_resharded(self, states: list[dict]) -> None:
        """Continue the stream that data ranks ``0..len(states)-1`` were reading (``states[r]`` is
        old rank ``r``'s :meth:`state_dict`) as this loader's (dp_rank, dp_world_size), with any
        number of loader workers on either side: every row of the oldest epoch that no old
        shard read and every buffered document is dealt out once over the new shards, then
        the stream goes on with the next epoch (``torchtitan_omni.data.resplit``)."""
        shard_states = old_shard_states(states)
        counts = self.dataset.load_resplit(shard_states)
        # start afresh from the dataset (and its plan), not from a StatefulDataLoader state
        restart_loader_from_dataset(self)
        self._skipped = {}
        if self.dp_rank == 0:  # the old counters were moved onto new shard 0
            self._skipped[0] = {r: int(counts.get(r, 0)) for r in REASONS}

    def stats(self) -> dict[str, int]:
        """Samples skipped so far per reason, over this rank's workers (as of their last batch)."""
        out = dict.fromkeys(REASONS, 0)
        for counts in self._skipped.values():
            for reason, n in counts.items():
                out[reason] = out.get(reason, 0) + int(n)
        return out


def one_line(error: OmniInputError) -> OmniInputError:
    """``error`` with its own one-line message: torch re-raises an exception of a loader worker
    as the same type whose message is the worker's whole traceback."""
    lines = str(error).strip().splitlines()
    if len(lines) < 2 or not lines[0].startswith("Caught "):
        return error
    marker = f"{type(error).__name__}: "
    last = lines[-1]
    at = last.find(marker)
    return type(error)(last[at + len(marker):]) if at >= 0 else error


def old_shard_states(states: list[dict]) -> list[dict]:
    """The dataset states of the old shards (rank ``r``, worker ``w`` of ``W``: shard
    ``r * W + w``) in TorchTitan loader states (``{"dp_rank_<r>": pickled StatefulDataLoader
    state, "world_size": D}``), without or with loader workers."""
    if not states:
        raise ValueError("no dataloader state to re-split")
    out: list[list[dict]] = []
    for r, st in enumerate(states):
        key = loader_state_key_of_rank(r)
        if not isinstance(st, dict) or key not in st:
            raise ValueError(f"the dataloader state of old data rank {r} has no {key!r} entry "
                             "(not written by torchtitan-omni's loader)")
        if int(st.get("world_size", len(states))) != len(states):
            raise ValueError(f"old data rank {r}'s dataloader state says {st['world_size']} data "
                             f"ranks, the checkpoint has {len(states)}")
        inner = pickle.loads(st[key]) if isinstance(st[key], bytes) else st[key]
        behind = loader_steps_since_snapshot(inner)
        if behind:  # num_workers > 0 and snapshot_every_n_steps > 1
            raise ValueError(
                f"old data rank {r}'s dataloader state is {behind} batch(es) past its last "
                "worker snapshot (snapshot_every_n_steps > 1): the rows those batches took are "
                "unknown, so it cannot be re-split; keep the data-parallel size, or pass "
                "--checkpoint.exclude_from_loading dataloader"
            )
        shards = loader_dataset_states(inner)
        if shards is None:
            raise ValueError(f"old data rank {r}'s dataloader state has an unknown format "
                             f"(keys {sorted(inner)[:8]})")
        if any(d is None for d in shards):
            raise ValueError(f"old data rank {r}'s dataloader state holds no dataset position")
        out.append(shards)
    counts = {len(w) for w in out}
    if len(counts) != 1:
        raise ValueError(
            f"old data ranks ran different numbers of loader workers ({sorted(counts)})")
    return [d for shards in out for d in shards]


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


def kept_processing(configs: dict[str, Any], data) -> dict[str, Any]:
    """The processing configs (of the modalities a model declares) that ``data.modalities``
    keeps: all of them for ``["all"]``, else those it names."""
    if list(data.modalities) == [ALL_MODALITIES]:
        return dict(configs)
    return {m: c for m, c in configs.items() if m in data.modalities}


def model_processing(job_config) -> dict[str, Any]:
    """The model's processing config per modality, limited to ``data.modalities``."""
    # the job's args: flavor "hf" and model.parts_flavor change the encoders (TorchTitan's
    # trainer builds the data loader before it updates the registered args)
    args = job_model_args(job_config)
    configs = dict(args.processing()) if hasattr(args, "processing") else {}
    return kept_processing(configs, job_config.data)


def check_data_config(data, seq_len: int) -> None:
    """Raise ValueError naming the first impossible [data] value (also run at start-up)."""
    known = modality_names()
    if ALL_MODALITIES in data.modalities and len(data.modalities) > 1:
        raise ValueError(
            f"data.modalities: {ALL_MODALITIES!r} (every modality the model declares) stands "
            f"alone, got {list(data.modalities)}; list the modalities to keep instead"
        )
    unknown = set(data.modalities) - set(known) - {ALL_MODALITIES}
    if unknown:
        raise ValueError(
            f"data.modalities has unknown {sorted(unknown)} (known: {', '.join(known)}; a new "
            "modality is added with torchtitan_omni.protocols.modality.register_modality)"
        )
    if not 0.0 <= data.gen_cfg_drop_prob <= 1.0:
        raise ValueError(f"data.gen_cfg_drop_prob must be in [0, 1], got {data.gen_cfg_drop_prob}")
    if data.token_budget < 0:
        raise ValueError(f"data.token_budget must be >= 0, got {data.token_budget}")
    if data.buffer_docs < 1 or data.pad_multiple < 1:
        raise ValueError("data.buffer_docs and data.pad_multiple must be >= 1")
    if seq_len < 8:
        raise ValueError(f"training.seq_len={seq_len} is too short for any sample")


def auto_workers(cpu_count: int | None = None, local_ranks: int | None = None,
                 on_gpu: bool | None = None) -> int:
    """Loader workers per rank for ``num_workers = -1``. GPU runs: the cores each local rank
    has, less one for the training process, at most 4 (more rarely pays: a worker decodes a
    batch in tens of milliseconds, a step takes hundreds). CPU runs: none, since the training
    processes compute on every core and a worker would only take cores from them."""
    on_gpu = (not is_cpu()) if on_gpu is None else on_gpu
    if not on_gpu:
        return 0
    cpu_count = cpu_count or os.cpu_count() or 1
    local_ranks = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(0, min(4, cpu_count // max(1, local_ranks) - 1))


def resolved_loader_options(options) -> dict[str, Any]:
    """``[training.dataloader]`` as StatefulDataLoader arguments: ``num_workers = -1``
    resolved by :func:`auto_workers`, pinning only where there is a GPU to copy to, and the
    worker-only options dropped without workers."""
    kwargs = asdict(options)
    if kwargs["num_workers"] < 0:
        kwargs["num_workers"] = auto_workers()
    kwargs["pin_memory"] = bool(kwargs["pin_memory"]) and not is_cpu()
    if kwargs["num_workers"] == 0:
        kwargs["persistent_workers"] = False
        kwargs["prefetch_factor"] = None
    return kwargs


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
    data = job_config.data
    seq_len = seq_len or job_config.training.seq_len
    rows = local_batch_size or job_config.training.local_batch_size
    check_data_config(data, seq_len)
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
        raise ValueError(
            f"training.seq_len ({seq_len}) must be a multiple of parallelism.ulysses_degree "
            f"({ulysses})"
        )
    plan = BatchPlan(
        seq_len=seq_len, rows=rows, token_budget=data.token_budget, packing=data.packing,
        fixed_length=data.pad_to_fixed_length, multiple=math.lcm(data.pad_multiple, ulysses),
    )
    dataset = OmniDataset(
        source, encoder, plan, dp_rank=dp_rank, dp_world_size=dp_world_size,
        buffer_docs=data.buffer_docs, infinite=infinite, seed=data.shuffle_seed,
        bad_sample_policy=data.bad_sample_policy,
    )
    loader_kwargs = resolved_loader_options(job_config.training.dataloader)
    loader_kwargs.update(kwargs)
    logger.info(
        f"omni data: {len(files)} file(s) of split {split or data.split!r} under {root}, "
        f"modalities {', '.join(processors) or 'text only'}, rank {dp_rank}/{dp_world_size}, "
        f"{loader_kwargs['num_workers']} loader worker(s)"
    )
    return OmniDataLoader(dataset, dp_rank, dp_world_size, **loader_kwargs)
