"""Run a convergence recipe and plot its loss curves, or compare the curves of several runs.

    # train train_configs/convergence/llama_omni_debug.toml (2 CPU processes, a few minutes),
    # then write curves/*.png and summary.md into the run folder
    python scripts/reproduce_convergence.py --model llama_omni --size debug
    # the figures and summary of a finished run again (no training)
    python scripts/reproduce_convergence.py --plot outputs/convergence/llama_omni_debug
    # overlay runs (e.g. SP1 vs SP2) and print how far each is from the first
    python scripts/reproduce_convergence.py --compare RUN_DIR RUN_DIR ... [--out DIR]

Extra ``--section.key value`` arguments after ``--`` go to ``run_train.sh``. A run folder is
the job's dump folder; its TensorBoard logs are read from any depth below it. Plotting needs
matplotlib (``pip install -e '.[eval]'``). See docs/convergence.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # run from a checkout without installing

from torchtitan_omni.eval.curves import compare_runs, read_scalars  # noqa: E402

MODELS = ("janus", "llama_omni", "qwen3_moe_omni")
SIZES = ("debug", "small", "full")


def recipe_path(model: str, size: str) -> str:
    """The recipe TOML of a model and size."""
    return os.path.join(REPO, "train_configs", "convergence", f"{model}_{size}.toml")


def default_ngpu(size: str) -> int:
    """Processes for a recipe: 2 CPU processes for debug, every visible GPU otherwise."""
    if size == "debug":
        return 2
    import torch

    return max(1, torch.cuda.device_count())


def train(model: str, size: str, out: str, ngpu: int, extra: list[str]) -> tuple[int, str]:
    """Run the recipe through run_train.sh into ``out``; returns (exit code, command)."""
    config = recipe_path(model, size)
    if not os.path.isfile(config):
        raise SystemExit(f"reproduce_convergence: no recipe {config}")
    args = ["bash", os.path.join(REPO, "run_train.sh"), "--job.dump_folder", out,
            "--metrics.enable_tensorboard", *extra]
    env = {**os.environ, "NGPU": str(ngpu), "CONFIG_FILE": config}
    command = (f"NGPU={ngpu} CONFIG_FILE={os.path.relpath(config, REPO)} "
               + shlex.join(["./run_train.sh", *args[2:]]))
    print(f"reproduce_convergence: {command}", flush=True)
    return subprocess.run(args, cwd=REPO, env=env).returncode, command


def plot(run_dir: str, smoothing: float, command: str = "") -> str:
    """Write ``curves/*.png`` and ``summary.md`` for a run folder; returns the summary path."""
    from torchtitan_omni.eval.plots import plot_run, summary_markdown

    scalars = read_scalars(run_dir)
    name = os.path.basename(os.path.normpath(run_dir))
    figures = plot_run(scalars, os.path.join(run_dir, "curves"), smoothing, title=name)
    text = summary_markdown(scalars, f"Convergence: {name}", command,
                            [os.path.join("curves", os.path.basename(f)) for f in figures])
    path = os.path.join(run_dir, "summary.md")
    with open(path, "w") as f:
        f.write(text)
    print(f"reproduce_convergence: {len(figures)} figure(s) in {run_dir}/curves, summary {path}")
    return path


def compare(run_dirs: list[str], out: str, smoothing: float, labels: list[str] | None) -> dict:
    """Overlay the runs' loss curves in ``out`` and print each run's max and mean relative
    difference from the first, per curve; returns ``compare_runs``' result."""
    from torchtitan_omni.eval.plots import plot_comparison

    labels = labels or [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    if len(labels) != len(run_dirs):
        raise SystemExit(f"reproduce_convergence: {len(labels)} --labels for {len(run_dirs)} runs")
    runs = [read_scalars(d) for d in run_dirs]
    result = compare_runs(runs)
    if not result:
        raise SystemExit("reproduce_convergence: the runs share no loss curve")
    plot_comparison(list(zip(labels, runs)), list(result), out, smoothing)
    print(f"relative difference from {labels[0]} (|run - {labels[0]}| / |{labels[0]}|, "
          "over the steps both logged):")
    for tag, per_run in result.items():
        for label, (mx, mean, n) in zip(labels[1:], per_run):
            print(f"  {tag:40s} {label:24s} max {mx:.3e}  mean {mean:.3e}  ({n} steps)")
    print(f"reproduce_convergence: {len(result)} comparison figure(s) in {out}")
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--model", choices=MODELS, help="train this model's recipe")
    mode.add_argument("--plot", metavar="RUN_DIR", help="only plot a finished run")
    mode.add_argument("--compare", nargs="+", metavar="RUN_DIR", help="overlay runs")
    p.add_argument("--size", choices=SIZES, default="debug")
    p.add_argument("--ngpu", type=int, default=0, help="processes (default: per size)")
    p.add_argument("--out", default="", help="run folder (training) or figure folder (compare)")
    p.add_argument("--labels", nargs="+", help="names of the compared runs")
    p.add_argument("--smoothing", type=float, default=0.6, help="EMA weight in [0, 1)")
    args = p.parse_args(argv)
    if args.compare:
        if len(args.compare) < 2:
            p.error("--compare needs at least two run folders")
        compare(args.compare, args.out or "outputs/convergence/compare", args.smoothing,
                args.labels)
        return 0
    if args.plot:
        plot(args.plot, args.smoothing)
        return 0
    out = args.out or os.path.join("outputs", "convergence", f"{args.model}_{args.size}")
    code, command = train(args.model, args.size, out, args.ngpu or default_ngpu(args.size), extra)
    if code != 0:
        print(f"reproduce_convergence: training failed (exit {code})", file=sys.stderr)
        return code
    plot(out, args.smoothing, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
