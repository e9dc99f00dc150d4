"""Layout-invariant random initialization.

Every parameter draws from its own generator, seeded by the run's seed and the parameter's
fully qualified name, and always draws the *full* tensor; a sharded parameter (DTensor) then
keeps its local slice. So the same seed gives the same full weights on 1 rank or 8, with FSDP,
sequence or expert parallel, which is what the parity tests rely on.

Model code calls :func:`normal_`, :func:`trunc_normal_`, :func:`uniform_` or
:func:`constant_` on its parameters inside ``init_weights``; ``OmniModel.init_weights`` opens
an :func:`init_context` that names the parameters.
"""

from __future__ import annotations

import contextlib
import math
import threading
import zlib
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

_state = threading.local()


@contextlib.contextmanager
def init_context(module: nn.Module, seed: int = 0, prefix: str = "") -> Iterator[None]:
    """Name ``module``'s parameters and buffers so the init helpers can seed per tensor."""
    names = {id(t): prefix + n for n, t in module.named_parameters(remove_duplicate=False)}
    names.update({id(t): prefix + n for n, t in module.named_buffers(remove_duplicate=False)})
    previous = getattr(_state, "ctx", None)
    _state.ctx = (names, int(seed))
    try:
        yield
    finally:
        _state.ctx = previous


def _generator_for(tensor: torch.Tensor, device: torch.device) -> torch.Generator:
    ctx = getattr(_state, "ctx", None)
    if ctx is None:
        raise RuntimeError(
            "parameter initialized outside torchtitan_omni.modules.init.init_context; "
            "call the model's init_weights through OmniModel.init_weights"
        )
    names, seed = ctx
    name = names.get(id(tensor))
    if name is None:
        raise RuntimeError(f"tensor of shape {tuple(tensor.shape)} is not a named parameter")
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1))
    return g


def _fill(tensor: torch.Tensor, draw: Callable[[torch.Tensor, torch.Generator], None]) -> None:
    """Draw the full tensor with its own generator and keep this rank's part."""
    with torch.no_grad():
        if isinstance(tensor, DTensor):
            device = tensor.to_local().device
            full = torch.empty(tensor.shape, dtype=torch.float32, device=device)
            draw(full, _generator_for(tensor, device))
            local = distribute_tensor(
                full, tensor.device_mesh, tensor.placements, src_data_rank=None
            ).to_local()
            tensor.to_local().copy_(local)
        else:
            full = torch.empty(tensor.shape, dtype=torch.float32, device=tensor.device)
            draw(full, _generator_for(tensor, tensor.device))
            tensor.copy_(full)


def normal_(tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    """Layout-invariant ``nn.init.normal_``."""
    _fill(tensor, lambda t, g: t.normal_(mean, std, generator=g))
    return tensor


def trunc_normal_(
    tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, a: float | None = None,
    b: float | None = None,
) -> torch.Tensor:
    """Layout-invariant truncated normal; the cut-offs default to +-2 std around the mean."""
    lo = mean - 2 * std if a is None else a
    hi = mean + 2 * std if b is None else b
    _fill(tensor, lambda t, g: nn.init.trunc_normal_(t, mean, std, lo, hi, generator=g))
    return tensor


def uniform_(tensor: torch.Tensor, a: float = 0.0, b: float = 1.0) -> torch.Tensor:
    """Layout-invariant ``nn.init.uniform_``."""
    _fill(tensor, lambda t, g: t.uniform_(a, b, generator=g))
    return tensor


def kaiming_uniform_linear_(tensor: torch.Tensor) -> torch.Tensor:
    """``nn.Linear``'s default weight init (kaiming uniform, a=sqrt(5)), layout-invariant."""
    fan_in = tensor.shape[-1] if tensor.dim() > 1 else tensor.shape[0]
    for d in tensor.shape[1:-1]:
        fan_in *= d
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return uniform_(tensor, -bound, bound)


def constant_(tensor: torch.Tensor, value: float) -> torch.Tensor:
    """Fill with a constant (needs no generator, but keeps DTensors whole)."""
    with torch.no_grad():
        target = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        target.fill_(value)
    return tensor


def zeros_(tensor: torch.Tensor) -> torch.Tensor:
    """Fill with zeros."""
    return constant_(tensor, 0.0)


def ones_(tensor: torch.Tensor) -> torch.Tensor:
    """Fill with ones."""
    return constant_(tensor, 1.0)
