"""``python -m torchtitan_omni.config.check --job.config_file F [...]``: validate a config.

Exits 0 when the config (with the given overrides, for ``NGPU`` processes) is valid, else
prints one line naming the problem and exits 2. With ``--help`` it prints every key, with its
value under the config, and exits 0 (``run_train.sh --help`` shows this, without torchrun).
``run_train.sh`` runs it before torchrun so a bad key fails once, not once per rank.
"""

from __future__ import annotations

import sys

import torchtitan_omni  # noqa: F401
from torchtitan_omni.config.manager import parse_job_config_or_exit


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    # --help prints every key with its value under this config, then exits 0
    parse_job_config_or_exit(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
