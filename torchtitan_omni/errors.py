"""The error class of bad input: a config, data, checkpoint or weights problem.

Its message names the problem (the key, the file, the tensor, the sample and row). The entry
points (``torchtitan_omni.train``, ``torchtitan_omni.generate``, the scripts) print it on one
line and exit with status 1 instead of showing a traceback; anything else is a bug and keeps
its traceback.
"""


class OmniInputError(Exception):
    """Bad input from the user; the message alone says what to fix."""


class ConfigError(OmniInputError, ValueError):
    """A configuration problem; its message is one line that names the key or file."""


class CheckpointFormatError(OmniInputError, ValueError):
    """A checkpoint folder or file is missing, malformed or does not match the model."""


class DataFileError(OmniInputError, ValueError):
    """A data file that cannot be read at all (unreadable, truncated, not the format it claims)."""


class HFConfigError(OmniInputError, ValueError):
    """A Hugging Face ``config.json`` that is missing or describes a model this code cannot
    build (``model.flavor = "hf"``)."""
