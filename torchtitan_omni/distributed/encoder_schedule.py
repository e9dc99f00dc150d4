"""The order of a training step's micro-batches on both rank sets of non-colocated encoders
(``parallelism.encoder_schedule``).

Per micro-batch i the world group carries, in this order: ``M_i`` (metadata) and ``X_i``
(media to the encoder ranks), ``E_i`` (embedding rows back), ``G_i`` (the rows' gradients, in
the LLM ranks' backward). Both sides must issue them in the same order:

- ``"sync"``: ``M_i X_i E_i G_i`` per micro-batch. The encoder ranks wait while the LLM
  ranks run forward and backward of i, the LLM ranks while the encoder ranks encode i.
- ``"pipelined"``: ``M_1 X_1 E_1 M_2 X_2 | G_1 E_2 M_3 X_3 | G_2 E_3 M_4 X_4 | ... | G_n``.
  The LLM ranks send micro-batch i+1's media before the forward of i; the encoder ranks
  encode i+1 while the LLM ranks compute i, and after ``G_i`` they first send ``E_{i+1}`` and
  take ``M_{i+2} X_{i+2}``, then run the encoders' backward of i, which with the encoding of
  i+2 overlaps the LLM ranks' forward and backward of i+1. Exact: the encoder weights do not
  change within a step, and the encoders' gradients accumulate in micro-batch order as in
  ``"sync"``. The cost: the encoder ranks keep the graphs of two micro-batches.

``X`` is launched asynchronously (``comm.all_to_all_v_start``) and waited where its rows are
needed (``EncoderClient.receive``, ``EncoderServer.encode``), so in ``"pipelined"``
``X_{i+2}`` travels while the LLM ranks compute i+1 and the encoder ranks run the backward
of i; ``M``, ``E`` and ``G`` are blocking, each issued where the other set waits for it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TypeVar

import torch

from torchtitan_omni.distributed.noncolocated import EncoderClient, EncoderServer

T = TypeVar("T")
#: one micro-batch's media and the modalities absent from it on every rank
Media = tuple[dict[str, torch.Tensor], Collection[str]]


def run_micro_batches(client: EncoderClient | None, n: int, schedule: str,
                      media: Callable[[int], Media], run: Callable[[int], T]) -> list[T]:
    """An LLM rank's ``n`` micro-batches: ``run(i)`` runs forward and backward of micro-batch
    i (the stubs take the rows of the exchange before it), ``media(i)`` its media, called
    when it is sent. Without ``client`` (colocated encoders) just ``run`` each in order."""
    if client is None:
        return [run(i) for i in range(n)]
    if schedule == "sync":
        out = []
        for i in range(n):
            client.exchange(*media(i))
            out.append(run(i))
        return out
    client.send(*media(0))
    client.receive()
    if n > 1:
        client.send(*media(1))
    out = []
    for i in range(n):
        out.append(run(i))  # G_i from the backward
        if i + 1 < n:
            client.receive()
        if i + 2 < n:
            client.send(*media(i + 2))
    return out


def serve_micro_batches(server: EncoderServer, n: int, schedule: str) -> None:
    """An encoder rank's side of :func:`run_micro_batches` for ``n`` micro-batches (the
    order of the module docstring); ``server.events`` says what ran when."""
    if schedule == "sync":
        for _ in range(n):
            server.step()
            server.backward()
        return
    server.receive()
    server.encode()
    server.send_rows()
    if n > 1:
        server.receive()
    for i in range(n):
        if i + 1 < n:
            server.encode()  # i+1, while the LLM ranks compute i
        server.receive_grads()  # G_i
        if i + 1 < n:
            server.send_rows()  # E_{i+1}
        if i + 2 < n:
            server.receive()  # M_{i+2} X_{i+2}
        server.backward_encoders()  # i
