"""Type-check ``torchtitan_omni`` with mypy against a baseline that may only shrink.

    python3 scripts/check_types.py            # fails on errors not in the baseline
    python3 scripts/check_types.py --update   # drops the baseline's fixed entries

mypy's settings live in ``pyproject.toml`` (``[tool.mypy]``). The baseline,
``.ci/mypy-baseline.txt``, lists the errors the code had when type checking was introduced,
one per line as ``path: [code] message`` (no line numbers, so edits elsewhere in a file do not
disturb it; a repeated error is listed as often as it occurs). The check fails when mypy reports
an error the baseline does not hold, and also when the baseline holds errors that are gone, so
that a fixed error cannot come back unnoticed: ``--update`` then removes them. ``--update``
never adds an entry (except when no baseline exists yet, where it writes the current errors).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASELINE = REPO / ".ci" / "mypy-baseline.txt"
# path:line[:column]: error: message  [code]
_ERROR = re.compile(
    r"^(?P<path>[^:]+):\d+(?::\d+)?: error: (?P<msg>.*?)(?:  \[(?P<code>[a-z-]+)\])?$"
)


def run_mypy() -> list[tuple[str, str]]:
    """mypy's errors as (entry without line numbers, the line mypy printed)."""
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", "--no-pretty", "--show-error-codes"],
        cwd=REPO, capture_output=True, text=True,
    )
    if proc.returncode not in (0, 1):  # 2: mypy itself failed (bad config, crash)
        sys.exit(f"check_types: mypy failed:\n{proc.stdout}{proc.stderr}")
    errors = []
    for line in proc.stdout.splitlines():
        m = _ERROR.match(line)
        if m:
            # messages may name other lines ("defined on line 12"): not part of the identity
            msg = re.sub(r"\bline \d+", "line N", m["msg"])
            errors.append((f"{m['path']}: [{m['code'] or 'misc'}] {msg}", line))
    return errors


def read_baseline() -> Counter[str] | None:
    """The baseline's entries with their counts (None: no baseline file)."""
    if not BASELINE.is_file():
        return None
    lines = BASELINE.read_text().splitlines()
    return Counter(line for line in lines if line and not line.startswith("#"))


def write_baseline(entries: Counter[str]) -> None:
    """Write ``entries`` sorted, with a header that says what the file is."""
    header = ("# mypy errors of torchtitan_omni accepted for now; this list may only shrink.\n"
              "# Written by scripts/check_types.py --update; see docs/contributing.md.\n")
    BASELINE.write_text(header + "".join(f"{e}\n" for e in sorted(entries.elements())))


def main(argv: list[str] | None = None) -> int:
    """Run the check (or ``--update``); returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true",
                        help="remove fixed errors from the baseline (never adds any)")
    args = parser.parse_args(argv)
    errors = run_mypy()
    current = Counter(entry for entry, _ in errors)
    baseline = read_baseline()
    if baseline is None:
        if not args.update:
            print(f"check_types: no baseline at {BASELINE}; create it with --update")
            return 1
        write_baseline(current)
        print(f"check_types: wrote a baseline of {sum(current.values())} errors to {BASELINE}")
        return 0
    new = current - baseline
    fixed = baseline - current
    if new:
        print(f"check_types: {sum(new.values())} type error(s) not in the baseline "
              f"({BASELINE.relative_to(REPO)}); fix them:")
        budget = dict(new)
        for entry, line in errors:
            if budget.get(entry, 0) > 0:
                budget[entry] -= 1
                print(f"  {line}")
        return 1
    if args.update:
        write_baseline(baseline - fixed)
        print(f"check_types: removed {sum(fixed.values())} fixed error(s); the baseline holds "
              f"{sum((baseline - fixed).values())}")
        return 0
    if fixed:
        print(f"check_types: {sum(fixed.values())} baseline error(s) are fixed; shrink the "
              "baseline with: python3 scripts/check_types.py --update")
        for entry in sorted(fixed.elements()):
            print(f"  {entry}")
        return 1
    print(f"check_types: OK ({sum(current.values())} known errors in the baseline, no new ones)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
