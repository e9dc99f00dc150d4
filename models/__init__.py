"""The model zoo: importing this package registers every omni train spec with TorchTitan."""
