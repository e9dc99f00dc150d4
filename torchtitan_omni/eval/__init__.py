"""Held-out evaluation: the in-training validator, the modality mixes of documents, task
metrics on a checkpoint, and the loss curves of convergence runs (``docs/convergence.md``)."""
