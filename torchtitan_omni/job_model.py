"""A job's train spec, model args and model, outside the trainer (converter, generation, data
loader, benchmarks), built the way TorchTitan's trainer builds them: on the meta device under
``training.dtype``, then parallelized, then only local shards materialized and initialized.

The spec comes from TorchTitan's registry: the zoo registers itself when
``torchtitan_omni.models`` is imported, which parsing a config does
(``torchtitan_omni.config.validate``); ``experimental.custom_import`` is imported here.
"""

from __future__ import annotations

import copy
import importlib

import torch
import torch.nn as nn

from torchtitan.config import TORCH_DTYPE_MAP, JobConfig
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec
from torchtitan.tools import utils


def train_spec_of(cfg: JobConfig) -> TrainSpec:
    """The job's ``TrainSpec`` (``experimental.custom_import`` imported first)."""
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
