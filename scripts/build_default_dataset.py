#!/usr/bin/env python
"""Build the bundled default dataset (``training.dataset = "omni_default"``) offline.

    python scripts/build_default_dataset.py [--out ./data/omni_default]
        [--tokenizer-dir ./assets/tokenizer] [--seed 0] [--force]

Writes train/val/test JSONL files and media into ``--out`` and installs its byte-level BPE
tokenizer into ``--tokenizer-dir`` (``model.hf_assets_path`` of the default configs) unless one
is there. Needs only installed packages (scikit-learn, scikit-image, espeakng-loader, av,
soundfile, tokenizers): no network. The trainer runs the same build on first use.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="./data/omni_default")
    parser.add_argument("--tokenizer-dir", default="./assets/tokenizer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args(argv)

    from torchtitan_omni.data.default_dataset import MANIFEST, ensure_default_dataset

    out = Path(args.out)
    if args.force and out.exists():
        shutil.rmtree(out)
    start = time.time()
    try:
        path = ensure_default_dataset(out, args.tokenizer_dir, seed=args.seed)
    except ImportError as e:
        print(f"build_default_dataset: missing package: {e}", file=sys.stderr)
        return 1
    manifest = json.loads((path / MANIFEST).read_text())
    for split, tasks in manifest["splits"].items():
        print(f"{split:>5}: " + ", ".join(f"{t} {n}" for t, n in sorted(tasks.items())))
    print(f"dataset in {path} (built in {manifest['build_seconds']} s; this call "
          f"{time.time() - start:.1f} s), tokenizer in {args.tokenizer_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
