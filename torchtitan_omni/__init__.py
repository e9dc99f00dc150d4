"""torchtitan-omni: omni-modal training on TorchTitan 0.2.2.

Importing the package selects the device (CUDA/NCCL or CPU/gloo) before any TorchTitan module
that copies TorchTitan's device type is loaded; see ``torchtitan_omni.platform``.
"""

from torchtitan_omni.platform import select_device as _select_device

_select_device()

__version__ = "0.1.0"
