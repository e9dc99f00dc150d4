"""The README's commands name files that exist: configs, scripts, and the media of the bundled
dataset (built here when missing, as the first training run would)."""

import re

from tests.harness import REPO
from torchtitan_omni.data.default_dataset import ensure_default_dataset

#: path-like words of the README's shell blocks under these folders
ROOTS = ("train_configs/", "scripts/", "data/omni_default/", "docs/", "tests/")


def _commands() -> str:
    text = (REPO / "README.md").read_text()
    return "\n".join(re.findall(r"```bash\n(.*?)```", text, flags=re.S))


def test_files_in_the_readme_commands_exist():
    paths = sorted({w.strip("\"'") for w in _commands().split()
                    if w.strip("\"'").startswith(ROOTS) and "<" not in w})
    assert any(p.startswith("data/omni_default/") for p in paths)  # the generation example
    if any(p.startswith("data/omni_default/") for p in paths):
        ensure_default_dataset(REPO / "data" / "omni_default", REPO / "assets" / "tokenizer")
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing, f"README commands name files that do not exist: {missing}"
