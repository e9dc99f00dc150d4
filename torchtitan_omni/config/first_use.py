"""Quiet about what the first run builds: the bundled tokenizer's folder.

TorchTitan's config parser warns "HF assets path ... does not exist!" when
``model.hf_assets_path`` is missing. A job on the bundled dataset (``training.dataset =
"omni_default"`` with ``data.build_if_missing``) creates that folder itself on first use, so
the warning would only alarm (once per process that parses the config). The parser's warning
is held while it runs and shown afterwards only when nothing will create the folder.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from torchtitan.tools.logging import logger

from torchtitan_omni.data.default_dataset import DEFAULT_NAME


class _HeldWarnings(logging.Filter):
    """Holds TorchTitan's missing-assets warning back; :meth:`release` logs what it held."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("HF assets path") and message.endswith("does not exist!"):
            self.records.append(record)
            return False
        return True

    def release(self) -> None:
        """Log the held warnings after all."""
        for record in self.records:
            logger.handle(record)
        self.records.clear()


@contextmanager
def held_assets_warning() -> Iterator[_HeldWarnings]:
    """While inside, TorchTitan's missing-assets warning is held by the yielded filter."""
    held = _HeldWarnings()
    logger.addFilter(held)
    try:
        yield held
    finally:
        logger.removeFilter(held)


def built_on_first_use(config) -> bool:
    """Whether the job creates ``model.hf_assets_path`` itself (the bundled tokenizer)."""
    return config.training.dataset == DEFAULT_NAME and bool(config.data.build_if_missing)
