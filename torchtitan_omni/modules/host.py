"""Host values onto the device without waiting for the device.

``torch.tensor(values, device="cuda")``, ``host_tensor.to("cuda")``, ``.tolist()`` or
``.item()`` of a device tensor and boolean-mask indexing all wait until every kernel queued
before them has run. In the encoder phase such a wait empties the GPU's queue, and the
launch-bound encoder blocks that follow then run with the GPU idle while the host launches
them (``docs/performance.md``, "Host syncs"). The encoders therefore read their items' sizes
from host tensors (the batch keeps integer media on the host,
``torchtitan_omni.protocols.batch``), build index tables on the host, and copy them here:
from pinned memory, queued behind the work already on the stream.
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(values: Any, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (a list or a host tensor) as a tensor on ``device``, copied without a host
    wait (a device tensor is only converted)."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type == "cpu" or host.device == device:
        return host
    if host.device.type == "cpu" and device.type == "cuda":
        host = host.pin_memory()  # a pageable source would make the copy wait for the stream
    return host.to(device, non_blocking=True)


class HostTensor:
    """A host tensor that module hooks pass through untouched. FSDP2's root pre-forward copies
    every tensor among a model's arguments to the device, synchronously; the media's item
    sizes (grids, lengths) must stay on the host, where the encoders read them without
    waiting. Not a container, so that copy leaves it alone (:func:`hold_on_host`)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def hold_on_host(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Forward keyword arguments with every host tensor wrapped in :class:`HostTensor` (the
    model's forward unwraps them: :func:`release_host`)."""
    return {k: HostTensor(v) if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v
            for k, v in kwargs.items()}


def release_host(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the tensors of :func:`hold_on_host` unwrapped."""
    return {k: v.tensor if isinstance(v, HostTensor) else v for k, v in kwargs.items()}
