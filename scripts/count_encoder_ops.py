"""Host ops per encoder block, counted on CPU: the aten ops one block issues in its forward and
its backward (issue 11: eager encoders are launch-bound on the GPU).

A block's count is the count of an encoder of two blocks minus that of one block, so whatever
the encoder computes once per forward (patch embedding, rotary tables, merger) stays out of it,
and whatever a block recomputes stays in. Every op dispatched below autograd counts, views
included (each is a host op; the "kernels" column leaves the aliasing ops out). The encoders
are small (one item of 256 patches or frames, head width 80) so the count runs in seconds; it
does not depend on the widths, but attention on CPU runs per item through the math kernel, so
its few dozen ops stand where the GPU issues one varlen kernel. These are CPU op counts, not
GPU timings.

    python3 scripts/count_encoder_ops.py            # a table, fp32 and CPU bf16 autocast
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ITEM = 16  # one image of 16 x 16 patches; 256 audio frames after the strided conv


#: names of the aliasing ops (views: no kernel) seen by any counter
ALIASING: set[str] = set()


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops[name] += 1
        if func.is_view:
            ALIASING.add(name)
        return func(*args, **(kwargs or {}))


def _vision(depth: int):
    from torchtitan_omni.encoders.vision import VisionArgs, VisionEncoder

    enc = VisionEncoder(VisionArgs(dim=320, depth=depth, n_heads=4), llm_dim=64)
    patch_dim = enc.args.patch_dim
    media = {"patches": torch.randn(ITEM * ITEM, patch_dim),
             "grid_thw": torch.tensor([[1, ITEM, ITEM]])}
    return enc, media, "image"


def _audio(depth: int):
    from torchtitan_omni.encoders.audio import AudioArgs, AudioEncoder

    enc = AudioEncoder(AudioArgs(n_mels=80, dim=320, n_layers=depth, n_heads=4, mlp_dim=1280),
                       llm_dim=64)
    frames = 2 * ITEM * ITEM
    media = {"features": torch.randn(1, 80, frames), "lengths": torch.tensor([frames])}
    return enc, media, "audio"


def _siglip(depth: int):
    from torchtitan_omni.encoders.siglip import SiglipArgs, SiglipEncoder

    enc = SiglipEncoder(SiglipArgs(image_size=8 * ITEM, patch_size=8, dim=320, n_layers=depth,
                                   n_heads=4, mlp_dim=1280), llm_dim=64)
    return enc, {"pixels": torch.randn(1, 3, 8 * ITEM, 8 * ITEM)}, "image"


ENCODERS: dict[str, Callable] = {"vision": _vision, "audio": _audio, "siglip": _siglip}


def encoder_ops(name: str, depth: int, autocast: bool) -> dict[str, collections.Counter]:
    """Op counts by name of one forward and one backward of encoder ``name`` with ``depth``
    blocks (CPU; ``autocast``: under bf16 autocast, as a one-GPU run without FSDP)."""
    from torchtitan_omni.modules.init import init_context

    torch.manual_seed(0)
    enc, media, modality = ENCODERS[name](depth)
    with init_context(enc, seed=0):
        enc.init_weights()
    fwd, bwd = OpCounter(), OpCounter()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        with fwd:
            out = enc(media, modality)
    grad = torch.randn(out.shape, dtype=out.dtype)
    with bwd:
        out.backward(grad)
    return {"forward": fwd.ops, "backward": bwd.ops}


def block_ops(name: str, autocast: bool = False) -> dict[str, collections.Counter]:
    """Op counts by name that one block of encoder ``name`` adds to the forward and to the
    backward: two blocks' counts minus one block's."""
    one, two = encoder_ops(name, 1, autocast), encoder_ops(name, 2, autocast)
    return {phase: two[phase] - one[phase] for phase in ("forward", "backward")}


def kernels(ops: collections.Counter) -> int:
    """The count of ``ops`` without the aliasing ones (views)."""
    return sum(n for name, n in ops.items() if name not in ALIASING)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--encoders", default=",".join(ENCODERS),
                        help="comma-separated, of: " + ", ".join(ENCODERS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| encoder | mode | forward ops (kernels) | backward ops (kernels) | total ops |")
    print("| --- | --- | --- | --- | --- |")
    for name in args.encoders.split(","):
        for autocast in (False, True):
            c = block_ops(name, autocast)
            f, b = c["forward"].total(), c["backward"].total()
            fk, bk = kernels(c["forward"]), kernels(c["backward"])
            mode = "bf16 autocast" if autocast else "fp32"
            print(f"| {name} | {mode} | {f} ({fk}) | {b} ({bk}) | {f + b} |")


if __name__ == "__main__":
    main()
