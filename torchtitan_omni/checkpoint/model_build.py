"""Building a job's model outside the trainer (converter, benchmark), the way the trainer does:
on the meta device under ``training.dtype``, then parallelized, then only local shards
materialized and initialized."""

from __future__ import annotations

import copy
import os
import socket

import torch
import torch.nn as nn

from torchtitan.config import TORCH_DTYPE_MAP, JobConfig
from torchtitan.tools import utils


def parse_config(config_file: str, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """A validated job config from a TOML file and ``--section.key value`` overrides."""
    from torchtitan_omni.config.manager import OmniConfigManager

    return OmniConfigManager().parse_args(["--job.config_file", config_file, *overrides])


def train_spec_of(cfg: JobConfig):
    """The job's ``TrainSpec`` (imports the zoo and ``experimental.custom_import``)."""
    import importlib

    import torchtitan_omni.models  # noqa: F401  (registers the zoo)
    from torchtitan.protocols.train_spec import get_train_spec

    if cfg.experimental.custom_import:
        importlib.import_module(cfg.experimental.custom_import)
    return get_train_spec(cfg.model.name)


def job_model_args(cfg: JobConfig):
    """The flavor's model args updated for the job (a copy; the registered ones stay)."""
    args = copy.deepcopy(train_spec_of(cfg).model_args[cfg.model.flavor])
    update = getattr(args, "update_from_config", None)
    if callable(update):
        update(cfg)
    return args


def model_on_meta(cfg: JobConfig) -> nn.Module:
    """The job's model on the meta device (names, shapes and adapters; no memory)."""
    spec = train_spec_of(cfg)
    args = job_model_args(cfg)
    with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[cfg.training.dtype]):
        return spec.model_cls(args)


def sharded_model(cfg: JobConfig, parallel_dims, device: torch.device) -> nn.Module:
    """Built on meta, parallelized, local shards materialized on ``device`` and initialized."""
    spec = train_spec_of(cfg)
    model = spec.parallelize_fn(model_on_meta(cfg), parallel_dims, cfg)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def init_process_group() -> None:
    """The process group of a standalone tool: torchrun's, or a single local process."""
    import torch.distributed as dist

    from torchtitan_omni.platform import is_cpu, local_device

    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
    if not is_cpu():
        torch.cuda.set_device(local_device())
    dist.init_process_group("gloo" if is_cpu() else "cuda:nccl,cpu:gloo")
