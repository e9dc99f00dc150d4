"""``TRAIN_FILE=tests.launcher_env_entry run_train.sh``: writes the launcher-set environment
variables a rank sees to ``$OMNI_ENV_FILE`` (JSON) and exits, without training."""

from __future__ import annotations

import json
import os

#: the variables ``run_train.sh`` gives the ranks a default for
LAUNCHER_DEFAULTS = ("CUDA_SCALE_LAUNCH_QUEUES", "PYTORCH_ALLOC_CONF")


def main() -> None:
    with open(os.environ["OMNI_ENV_FILE"], "w") as f:
        json.dump({name: os.environ.get(name) for name in LAUNCHER_DEFAULTS}, f)


if __name__ == "__main__":
    main()
