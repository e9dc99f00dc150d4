"""What every processor returns, and the processor interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan_omni.data.bad_samples import Source


@dataclass
class Item:
    """One processed media item: its tensors (keys without the modality prefix, no batch
    dimension) and the number of placeholder tokens it occupies in the LLM sequence."""

    tensors: dict[str, torch.Tensor]
    num_tokens: int


class Processor(ABC):
    """Turns media references of one modality into :class:`Item` and batches them."""

    def __init__(self, config: Any) -> None:
        self.config = config

    @abstractmethod
    def __call__(self, ref: Any, root: str, source: Source | None = None) -> list[Item]:
        """Items of one placeholder (usually one)."""

    @abstractmethod
    def collate(self, items: list[Item]) -> dict[str, torch.Tensor]:
        """The batch media tensors (keys without prefix) of ``items``, in order."""
