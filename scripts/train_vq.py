"""Train the VQ image tokenizer of the image-generation decoder and report its reconstruction
error on held-out images.

    python scripts/train_vq.py --flavor debug          # -> assets/vq/vq_debug/

Recipe: Adam, cosine decay after a warm-up; loss = L1 + L2 reconstruction + codebook loss +
beta x commitment loss, gradients through the quantizer by the straight-through estimator;
codes unused for ``--restart-every`` steps are re-seeded from the current batch's latents
(until 80% of training), which keeps the codebook in use. No perceptual or GAN term: the
reconstructions are blurrier than LlamaGen's, which is enough for training the decoder's
aligner and head on CPU; a real run should load a pretrained VQ (docs/encoders_decoders.md).

Data (``--data``): ``auto`` (the default) uses the images under ``data/omni_default`` when it
holds any, else ``builtin``: real images that ship with scikit-learn and scikit-image (8x8
handwritten digits, 25x25 faces, crops of the ~20 photographs of ``skimage.data``), with whole
images and digits set aside for evaluation. A directory is searched for image files: those
under a ``train`` folder train and those under ``test`` are held out (the bundled dataset's own
split, reported per group: digits, faces, photos, generate); without such folders every 10th
file (sorted) is held out.

The weights go to the folder ``--out`` (default ``assets/vq/vq_<flavor>``): ``model.safetensors``
with names relative to the tokenizer (``VQArgs`` and the held-out figures in its metadata),
``config.json`` and ``report.json``. A training config loads it with ``[weights] sources =
["decoders.gen_image.vq=assets/vq/vq_debug"]``; ``torchtitan_omni.decoders.vq.load_vq`` loads
it without the trainer. The figures are printed too.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif"}
# skimage.data photographs held out whole for evaluation (never cropped for training)
HELD_OUT_PHOTOS = ("chelsea", "coffee", "rocket")


# ----------------------------------------------------------------------------- data
def to_square(img: torch.Tensor, size: int) -> torch.Tensor:
    """``[3, H, W]`` in [0, 1] -> ``[3, size, size]``: shorter side resized, centre crop."""
    _, h, w = img.shape
    scale = size / min(h, w)
    nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
    img = F.interpolate(img[None], size=(nh, nw), mode="bilinear", align_corners=False,
                        antialias=scale < 1)[0]
    top, left = (nh - size) // 2, (nw - size) // 2
    return img[:, top:top + size, left:left + size].clamp(0, 1)


def rgb(array) -> torch.Tensor:
    """An image array (gray, RGB or RGBA, any integer or float range) as ``[3, H, W]`` in [0, 1]."""
    x = torch.as_tensor(array).float()
    if x.dim() == 2:
        x = x[..., None].expand(-1, -1, 3)
    x = x[..., :3]
    hi = float(x.max())
    x = x / (255.0 if hi > 1.0 else 1.0)
    return x.permute(2, 0, 1).contiguous()


def random_crops(img: torch.Tensor, size: int, n: int, g: torch.Generator) -> list[torch.Tensor]:
    """``n`` square crops at random scales (side between ``size`` and the image's shorter side)."""
    _, h, w = img.shape
    out = []
    for _ in range(n):
        side = int(torch.randint(min(size, min(h, w)), min(h, w) + 1, (1,), generator=g))
        top = int(torch.randint(0, h - side + 1, (1,), generator=g))
        left = int(torch.randint(0, w - side + 1, (1,), generator=g))
        out.append(to_square(img[:, top:top + side, left:left + side], size))
    return out


def builtin_images(size: int, crops_per_photo: int, seed: int = 0):
    """Train / held-out images from scikit-learn and scikit-image (no download needed)."""
    import skimage.data
    from sklearn.datasets import load_digits

    g = torch.Generator().manual_seed(seed)
    train: list[torch.Tensor] = []
    held: dict[str, list[torch.Tensor]] = {"digits": [], "faces": [], "photos": []}
    digits = load_digits().images / 16.0
    for i, d in enumerate(digits):
        (held["digits"] if i % 6 == 0 else train).append(to_square(rgb(d), size))
    faces = skimage.data.lfw_subset()
    for i, face in enumerate(faces):
        (held["faces"] if i % 5 == 0 else train).append(to_square(rgb(face), size))
    photos = []
    for name in sorted(n for n in dir(skimage.data) if not n.startswith("_")):
        if name in ("lfw_subset", "data_dir", "download_all", "file_hash", "cells3d", "brain",
                    "kidney", "lbp_frontal_face_cascade_filename", "stereo_motorcycle",
                    "protein_transport", "nickel_solidification", "vortex", "binary_blobs"):
            continue
        try:
            arr = getattr(skimage.data, name)()
        except Exception:  # noqa: BLE001  (photos that need a download (pooch) are skipped offline)
            continue
        if getattr(arr, "ndim", 0) not in (2, 3) or min(arr.shape[:2]) < size:
            continue
        photos.append(name)
        if name in HELD_OUT_PHOTOS:
            held["photos"] += random_crops(rgb(arr), size, crops_per_photo // 2, g)
        else:
            train += random_crops(rgb(arr), size, crops_per_photo, g)
    source = (f"builtin: {len(digits)} digits, {len(faces)} faces, {len(photos)} photos "
              f"({', '.join(photos)})")
    return _pack(train, held, source)


def _pack(train: list[torch.Tensor], held: dict[str, list[torch.Tensor]], source: str):
    """Stack to [-1, 1] tensors; drop empty held-out groups."""
    if not train:
        raise SystemExit(f"train_vq: no training images in {source}")
    held_t = {k: torch.stack(v) * 2 - 1 for k, v in held.items() if v}
    if not held_t:
        raise SystemExit(f"train_vq: no held-out images in {source}")
    return torch.stack(train) * 2 - 1, held_t, source


def directory_images(root: Path, size: int):
    """Every image file under ``root``. Files under a ``train`` folder train, files under
    ``test`` are held out (the dataset's own split; ``val`` is left alone), grouped by their
    first folder (``media/digits/test/...`` -> digits). Without split folders every 10th
    file (sorted) is held out."""
    import numpy as np
    from PIL import Image

    files = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if len(files) < 10:
        raise SystemExit(f"train_vq: {root} holds {len(files)} image files; need at least 10")
    split_folders = any("train" in p.relative_to(root).parts for p in files)
    train: list[torch.Tensor] = []
    held: dict[str, list[torch.Tensor]] = {}
    for i, path in enumerate(files):
        parts = path.relative_to(root).parts
        if split_folders:
            role = "train" if "train" in parts else ("test" if "test" in parts else None)
        else:
            role = "test" if i % 10 == 0 else "train"
        if role is None:
            continue
        try:
            with Image.open(path) as im:
                img = to_square(rgb(np.array(im.convert("RGB"))), size)
        except Exception as e:
            raise SystemExit(f"train_vq: cannot read image {path}: {e}") from e
        if role == "train":
            train.append(img)
        else:
            group = parts[1] if parts[0] == "media" and len(parts) > 2 else parts[0]
            held.setdefault(group, []).append(img)
    return _pack(train, held, f"{root} ({len(files)} image files)")


def load_data(spec: str, size: int, crops_per_photo: int):
    """(train ``[N, 3, S, S]``, held-out ``{group: [M, 3, S, S]}``, description), in [-1, 1]."""
    if spec == "auto":
        default = REPO / "data" / "omni_default"
        has_images = default.is_dir() and any(
            p.suffix.lower() in IMAGE_SUFFIXES for p in default.rglob("*"))
        spec = str(default) if has_images else "builtin"
    if spec == "builtin":
        return builtin_images(size, crops_per_photo)
    root = Path(spec)
    if not root.is_dir():
        raise SystemExit(f"train_vq: --data {spec!r} is neither 'auto', 'builtin' nor a directory")
    return directory_images(root, size)


# ----------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(vq, images: torch.Tensor, device: torch.device, batch: int = 64) -> dict:
    """Reconstruction MSE (on [-1, 1] pixels), PSNR (on [0, 1]) and codebook use."""
    vq.eval()
    se, count = 0.0, 0
    hist = torch.zeros(vq.args.codebook_size, dtype=torch.float64)
    for chunk in images.split(batch):
        x = chunk.to(device)
        codes = vq.encode(x)
        recon = vq.decode(codes).clamp(-1, 1)
        se += float(((recon - x) ** 2).sum())
        count += x.numel()
        hist += torch.bincount(codes.flatten().cpu(), minlength=hist.numel()).double()
    vq.train()
    mse = se / count
    p = hist / hist.sum()
    perplexity = float(torch.exp(-(p[p > 0] * p[p > 0].log()).sum()))
    return {"mse": round(mse, 6), "psnr_db": round(10 * math.log10(4.0 / mse), 3),
            "codes_used": int((hist > 0).sum()), "code_perplexity": round(perplexity, 1),
            "images": len(images)}


def evaluate_groups(vq, held: dict[str, torch.Tensor], device: torch.device) -> dict:
    """:func:`evaluate` per held-out group and over all of them."""
    out = {name: evaluate(vq, images, device) for name, images in held.items()}
    out["all"] = evaluate(vq, torch.cat(list(held.values())), device)
    return out


def print_figures(figures: dict) -> None:
    for name, r in figures.items():
        if name != "step":
            print(
                f"held-out {name:>8}: MSE {r['mse']:.5f} (pixels in [-1, 1]), PSNR "
                f"{r['psnr_db']:.2f} dB "
                f"over {r['images']} images, {r['codes_used']} codes used"
            )


# ----------------------------------------------------------------------------- training
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", choices=("debug", "real"), default="debug")
    parser.add_argument("--data", default="auto", help="auto, builtin, or a directory of images")
    parser.add_argument(
        "--out", default=None, help="output folder (default: assets/vq/vq_<flavor>)"
    )
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument(
        "--l1", type=float, default=1.0, help="weight of the L1 reconstruction loss"
    )
    parser.add_argument(
        "--l2", type=float, default=1.0, help="weight of the L2 reconstruction loss"
    )
    parser.add_argument("--restart-every", type=int, default=100)
    parser.add_argument("--crops-per-photo", type=int, default=150)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument(
        "--eval", metavar="FOLDER", help="only report the held-out error of these weights"
    )
    args = parser.parse_args(argv)

    sys.path.insert(0, str(REPO))
    from torchtitan_omni.decoders.vq import (
        VQArgs,
        VQTokenizer,
        load_vq,
        read_vq_args,
        restart_dead_codes,
        save_vq,
    )
    from torchtitan_omni.modules.init import init_context

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    torch.manual_seed(args.seed)
    if args.eval:
        vq_args = read_vq_args(args.eval)
    else:
        vq_args = VQArgs.debug() if args.flavor == "debug" else VQArgs()
    train, held, source = load_data(args.data, vq_args.image_size, args.crops_per_photo)
    n_held = sum(len(v) for v in held.values())
    print(f"data: {source}; {len(train)} training / {n_held} held-out images of "
          f"{vq_args.image_size} px; device {device}", flush=True)
    if args.eval:
        vq = VQTokenizer(vq_args)
        load_vq(vq, args.eval)
        figures = evaluate_groups(vq.to(device), held, device)
        print_figures(figures)
        return {"held_out": figures, "weights": args.eval}

    vq = VQTokenizer(vq_args)
    with init_context(vq, seed=args.seed):
        vq.init_weights()
    vq.to(device).train()
    opt = torch.optim.Adam(vq.parameters(), lr=args.lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))

    g = torch.Generator().manual_seed(args.seed)
    usage = torch.zeros(vq_args.codebook_size, device=device)
    history = [{"step": 0, **evaluate_groups(vq, held, device)}]
    print(f"step 0: held-out {history[-1]['all']}", flush=True)
    start = time.time()
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, len(train), (args.batch_size,), generator=g)
        x = train[idx]
        flip = torch.rand(args.batch_size, generator=g) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(-1), x).to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step - 1)
        out = vq(x, op="train")
        loss = (args.l1 * out.l1 + args.l2 * out.l2 + out.codebook_loss
                + vq_args.commitment * out.commitment_loss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        usage += torch.bincount(out.codes.flatten(), minlength=usage.numel())
        if step % args.restart_every == 0:
            restarted = 0
            if step < 0.8 * args.steps:
                restarted = restart_dead_codes(vq.quantizer, usage, out.z_flat.detach(), g)
            usage.zero_()
            if step % (args.restart_every * 5) == 0:
                print(
                    f"step {step}: loss {float(loss.detach()):.4f} l2 {float(out.l2.detach()):.4f} "
                    f"restarted {restarted} codes, {time.time() - start:.0f}s",
                    flush=True,
                )
        if step % args.eval_every == 0 or step == args.steps:
            history.append({"step": step, **evaluate_groups(vq, held, device)})
            print(f"step {step}: held-out {history[-1]['all']}", flush=True)

    final = history[-1]["all"]
    report = {"flavor": args.flavor, "data": source, "train_images": len(train),
              "held_out": history[-1], "history": history, "steps": args.steps,
              "seconds": round(time.time() - start, 1), "vq_args": json.loads(vq_args.to_json()),
              "recipe": {k: v for k, v in vars(args).items() if k not in ("out",)}}
    out = Path(args.out or REPO / "assets" / "vq" / f"vq_{args.flavor}")
    weights = save_vq(vq.cpu(), str(out), extra={
        "held_out_mse": f"{final['mse']:.6f}", "held_out_psnr_db": f"{final['psnr_db']:.3f}",
        "data": source})
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print_figures(history[-1])
    print(f"weights: {weights}; report: {out / 'report.json'}")
    return report


if __name__ == "__main__":
    main()
