"""Device values read on the host later, without draining the GPU's queue.

A log step needs a few device values on the host: the loss parts, the largest per-rank loss,
the gradient norm, the MoE routing counts. Reading them at once (``float(t)``, ``.cpu()``)
makes the host wait until the GPU has run everything queued, the whole step; the next step's
host work (staging its batch, the encoders' many small launches) then runs while the GPU
idles. :class:`DeferredRead` instead copies them into pinned host memory behind the kernels
queued so far; the trainer reads them at the end of the next step, by when the copy is
normally done, so that host work overlaps the step's tail. On CPU the copy is the read.

The copy's event is timed: it marks on the GPU's clock when the step's work was done, so that
a deferred line's throughput covers the GPU's time between two log steps, not the host's
(which runs ahead by a varying amount once it no longer waits).
"""

from __future__ import annotations

import math

import torch


class DeferredRead:
    """Named device tensors copied to the host behind the work queued so far; :meth:`result`
    waits for that copy only (not for work queued after it)."""

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        self._shapes = {name: tuple(value.shape) for name, value in values.items()}
        # one device for the copy (a value may sit elsewhere, e.g. a norm without gradients);
        # float64 holds the counts (int64) exactly up to 2**53 and the losses unrounded
        device = next((v.device for v in values.values() if v.is_cuda), torch.device("cpu"))
        flat = torch.cat([value.detach().reshape(-1).to(device, torch.float64, non_blocking=True)
                          for value in values.values()])
        self._event: torch.cuda.Event | None = None
        if flat.is_cuda:
            self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self._event = torch.cuda.Event(enable_timing=True)
            self._event.record()
        else:
            self._host = flat

    @property
    def mark(self) -> torch.cuda.Event | None:
        """The timed event recorded behind the copy (when the GPU reached it); None on CPU."""
        return self._event

    def done(self) -> bool:
        """Whether the copy has finished (never waits)."""
        return self._event is None or self._event.query()

    def result(self) -> dict[str, torch.Tensor]:
        """The values on the host, by name and in their shapes (float64); waits for the copy."""
        if self._event is not None:
            self._event.synchronize()
        out, start = {}, 0
        for name, shape in self._shapes.items():
            size = math.prod(shape)
            out[name] = self._host[start:start + size].view(shape)
            start += size
        return out
