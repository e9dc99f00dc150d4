"""Building an omni ``TrainSpec``: a model spec supplies its model class, flavors and HF
adapter; the framework supplies everything else (parallelize, data, loss, metrics)."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.protocols.train_spec import TrainSpec

from torchtitan_omni.components.loss import build_omni_loss
from torchtitan_omni.components.metrics import build_omni_metrics_processor
from torchtitan_omni.components.optimizer import build_omni_optimizers
from torchtitan_omni.data.loader import build_omni_dataloader
from torchtitan_omni.data.tokenizer import build_omni_tokenizer
from torchtitan_omni.distributed.parallelize import parallelize_omni
from torchtitan_omni.eval.validator import build_omni_validator


def omni_train_spec(model_cls, model_args: Mapping[str, object], state_dict_adapter=None,
                    build_dataloader_fn=None, build_tokenizer_fn=None) -> TrainSpec:
    """A ``TrainSpec`` with torchtitan-omni's parallelize, data, loss, metrics and validator
    (held-out batches from the spec's data loader builder)."""
    build_dataloader_fn = build_dataloader_fn or build_omni_dataloader
    build_tokenizer_fn = build_tokenizer_fn or build_omni_tokenizer
    return TrainSpec(
        model_cls=model_cls,
        model_args=model_args,
        parallelize_fn=parallelize_omni,
        pipelining_fn=None,
        build_optimizers_fn=build_omni_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_dataloader_fn,
        build_tokenizer_fn=build_tokenizer_fn,
        build_loss_fn=build_omni_loss,
        build_validator_fn=partial(build_omni_validator, build_dataloader_fn=build_dataloader_fn),
        build_metrics_processor_fn=build_omni_metrics_processor,
        state_dict_adapter=state_dict_adapter,
    )
