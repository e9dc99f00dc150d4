"""Throughput, MFU and peak memory of real-size training runs, one ``run_train.sh`` per point.

Each point of a plan is a full training job (the real trainer, data pipeline and
parallelism; random weights) on long omni documents built by
``scripts/build_long_context_dataset.py`` for its sequence length, so attention spans the
whole sequence. A plan may start with stock TorchTitan 0.2.2 (text-only Llama-3-8B on the
bundled text) as the baseline of the same call. For each point it reads the per-step log
lines and reports, over the steps after ``warmup``, the median real tokens/s per GPU, the
MFU by the trainer's model-FLOP count (causal attention by real document lengths, encoders
included), the MFU by TorchTitan's formula (``6 x non-embedding params + 12 x layers x
heads x head_dim x seq_len`` per token, what stock runs print) and the peak reserved memory.
Results go to a markdown table (with the exact command of each point) and a JSON file.

    python3 scripts/bench_scaling.py --plan llama_4gpu --out bench_llama.md
    python3 scripts/bench_scaling.py --plan moe_dispatch_4gpu --out bench_moe_dispatch.md
    python3 scripts/bench_scaling.py --plan smoke_cpu --out /tmp/smoke.md   # CPU, tiny models

MoE points also report the trainer's expert-load line: the worst layer's max/mean tokens per
expert and the share of (token, expert) copies dropped over capacity (medians).

``--deadline`` (seconds) skips the points that would not finish in time, by their estimates.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STOCK_TEXT = "data/stock_text"


@dataclass
class Point:
    """One training job of a plan."""

    name: str
    config: str
    ngpu: int
    seq_len: int
    args: tuple[str, ...] = ()
    steps: int = 10
    warmup: int = 3
    estimate_s: int = 90  # for --deadline
    stock: bool = False  # stock TorchTitan (torchtitan.train, Llama-3), else run_train.sh
    text_only: bool = False  # the bundled plain text instead of long omni documents
    env: dict[str, str] = field(default_factory=dict)

    def dataset(self) -> str:
        if self.stock or self.text_only:
            return STOCK_TEXT
        # per config: media token counts (and so what fits) depend on the model's processors
        stem = os.path.splitext(os.path.basename(self.config))[0]
        return f"data/long_context/{stem}_{self.seq_len // 1024}k"

    def command(self) -> list[str]:
        common = ["--training.seq_len", str(self.seq_len), "--training.steps", str(self.steps),
                  "--metrics.log_freq", "1", "--training.local_batch_size", "1"]
        if self.stock:
            return ["torchrun", f"--nproc_per_node={self.ngpu}", "--rdzv_backend", "c10d",
                    "--rdzv_endpoint=localhost:0", "--local-ranks-filter", "0", "--role", "rank",
                    "--tee", "3", "-m", "torchtitan.train", "--model.name", "llama3",
                    "--model.flavor", self.config, "--model.hf_assets_path", "assets/tokenizer",
                    "--training.dataset", "c4_test", "--training.dataset_path", self.dataset(),
                    "--job.dump_folder", f"outputs/bench_{self.name}", *common, *self.args]
        return ["./run_train.sh", "--training.dataset", "long_context", "--training.dataset_path",
                self.dataset(), "--job.dump_folder", f"outputs/bench_{self.name}",
                "--checkpoint.no-enable", "--metrics.no-enable_tensorboard",
                *common, *self.args]

    def environment(self) -> dict[str, str]:
        env = {"NGPU": str(self.ngpu), **self.env}
        if not self.stock:
            env["CONFIG_FILE"] = self.config
        return env

    def shell(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.environment().items())
        return f"{env} {shlex.join(self.command())}"


LLAMA8B = "train_configs/llama_omni_8B.toml"
MOE = "train_configs/qwen3_moe_omni_30B_A3B.toml"
SEL = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op")
FULL = ("--activation_checkpoint.mode", "full")
LLAMA_DATA = ("--data.modalities", "image,video")
MOE_12L = ("--omni.llm_layers", "12", "--data.modalities", "image,video")
COMPILE = ("--compile.enable", "--compile.components", "model,loss")


def _moe_layers(n: int) -> tuple[str, ...]:
    return ("--omni.llm_layers", str(n), "--data.modalities", "image,video")


def _cap(factor: float) -> tuple[str, ...]:
    # capacity-padded expert dispatch (0: exact uneven all-to-all)
    return ("--parallelism.expert_capacity_factor", str(factor))


def _sp(n: int) -> tuple[str, ...]:
    # each SP rank encodes a share of the media items (not all of them)
    return ("--parallelism.ulysses_degree", str(n), "--parallelism.encoder_sequence_parallel", "split")


def _ep(n: int) -> tuple[str, ...]:
    return ("--parallelism.expert_parallel_degree", str(n))


PLANS: dict[str, list[Point]] = {
    # LLaMA#Omni 8B (images and video), FSDP + Ulysses on 4 GPUs, stock TorchTitan first.
    "llama_4gpu": [
        Point("stock_llama3_8B_8k_fsdp4", "8B", 4, 8192, SEL, steps=12, stock=True, estimate_s=70),
        Point("omni_8B_8k_sp1", LLAMA8B, 4, 8192, LLAMA_DATA + SEL, steps=12, estimate_s=80),
        Point("omni_8B_32k_sp4", LLAMA8B, 4, 32768, LLAMA_DATA + SEL + _sp(4), steps=8, estimate_s=80),
        Point("omni_8B_128k_sp4_full_ac", LLAMA8B, 4, 131072, LLAMA_DATA + FULL + _sp(4),
              steps=5, warmup=2, estimate_s=150),
        Point("omni_8B_64k_sp4_full_ac", LLAMA8B, 4, 65536, LLAMA_DATA + FULL + _sp(4),
              steps=6, warmup=2, estimate_s=90),
        Point("omni_8B_16k_sp2", LLAMA8B, 4, 16384, LLAMA_DATA + SEL + _sp(2), steps=8, estimate_s=70),
        # the omni model on the stock run's text: the LLM path alone (every part skipped)
        Point("omni_8B_8k_text_only", LLAMA8B, 4, 8192, SEL, steps=12, text_only=True, estimate_s=70),
    ],
    # Qwen3-MoE#Omni at the 30B-A3B layer shape cut to 12 layers (as the VeOmni anchor on
    # 4x H200), EP4 and EP2 x SP2, full activation checkpointing.
    "moe_4gpu": [
        Point("moe_30B-A3B_12L_8k_ep4", MOE, 4, 8192, MOE_12L + FULL + _ep(4), steps=10, estimate_s=80),
        Point("moe_30B-A3B_12L_16k_ep4", MOE, 4, 16384, MOE_12L + FULL + _ep(4), steps=8, estimate_s=80),
        Point("moe_30B-A3B_12L_8k_ep2_sp2", MOE, 4, 8192, MOE_12L + FULL + _ep(2) + _sp(2),
              steps=10, estimate_s=80),
        Point("moe_30B-A3B_12L_32k_ep4", MOE, 4, 32768, MOE_12L + FULL + _ep(4), steps=6, estimate_s=90),
        Point("moe_30B-A3B_12L_64k_ep2_sp2", MOE, 4, 65536, MOE_12L + FULL + _ep(2) + _sp(2),
              steps=5, warmup=2, estimate_s=100),
    ],
    # MoE dispatch (issue 12): exact uneven all-to-all (host sync per layer) vs capacity-padded
    # (static splits), eager vs compiled blocks, at the 30B-A3B layer shape. 1 GPU (2 layers,
    # no EP: local dispatch), 2 GPUs (4 layers, EP2) and the 4-GPU anchor (12 layers, EP4).
    "moe_dispatch_1gpu": [
        Point(f"moe_2L_8k_1gpu_{tag}", MOE, 1, 8192, _moe_layers(2) + FULL + extra, steps=10,
              estimate_s=150 if COMPILE[0] in extra else 90)
        for tag, extra in (("exact", ()), ("exact_compile", COMPILE), ("cap1.25", _cap(1.25)),
                           ("cap1.25_compile", _cap(1.25) + COMPILE))
    ],
    "moe_dispatch_2gpu": [
        Point(f"moe_4L_8k_ep2_{tag}", MOE, 2, 8192, _moe_layers(4) + FULL + _ep(2) + extra,
              steps=10, estimate_s=150 if COMPILE[0] in extra else 90)
        for tag, extra in (("exact", ()), ("exact_compile", COMPILE), ("cap1.25", _cap(1.25)),
                           ("cap1.25_compile", _cap(1.25) + COMPILE))
    ],
    "moe_dispatch_4gpu": [
        *[Point(f"moe_30B-A3B_12L_8k_ep4_{tag}", MOE, 4, 8192, MOE_12L + FULL + _ep(4) + extra,
                steps=10, estimate_s=180 if COMPILE[0] in extra else 90)
          for tag, extra in (("exact", ()), ("exact_compile", COMPILE), ("cap1.0", _cap(1.0)),
                             ("cap1.25", _cap(1.25)), ("cap1.25_compile", _cap(1.25) + COMPILE),
                             ("cap2.0", _cap(2.0)))],
        Point("moe_30B-A3B_12L_16k_ep4_cap1.25_compile", MOE, 4, 16384,
              MOE_12L + FULL + _ep(4) + _cap(1.25) + COMPILE, steps=8, estimate_s=180),
    ],
    # The 8-GPU runs, for when nvidia-h200-x8 is lent.
    "llama_8gpu": [
        Point("stock_llama3_8B_8k_fsdp8", "8B", 8, 8192, SEL, steps=12, stock=True),
        *[Point(f"omni_8B_{s // 1024}k_sp{sp}", LLAMA8B, 8, s, LLAMA_DATA + (SEL if s <= 32768 else FULL)
                + _sp(sp), steps=6, warmup=2)
          for s, sp in ((8192, 1), (32768, 2), (65536, 4), (131072, 8), (196608, 8))],
    ],
    "moe_8gpu": [
        *[Point(f"moe_30B-A3B_{s // 1024}k_ep8", MOE, 8, s, FULL + _ep(8) + LLAMA_DATA, steps=6, warmup=2)
          for s in (8192, 16384, 32768, 65536)],
        Point("moe_30B-A3B_32k_ep4_sp2", MOE, 8, 32768, FULL + _ep(4) + _sp(2) + LLAMA_DATA, steps=6, warmup=2),
    ],
    # CPU check of the runner itself: tiny flavors, every kind of point.
    "smoke_cpu": [
        Point("smoke_llama_sp2", "train_configs/llama_omni_debug.toml", 2, 2048,
              LLAMA_DATA + _sp(2), steps=4, warmup=1),
        Point("smoke_moe_ep2", "train_configs/qwen3_moe_omni_debug.toml", 2, 1024,
              ("--omni.llm_layers", "1") + LLAMA_DATA + _ep(2),
              steps=4, warmup=1),
        Point("smoke_llama_text_only", "train_configs/llama_omni_debug.toml", 2, 1024, (),
              steps=4, warmup=1, text_only=True),
        Point("smoke_moe_ep2_capacity", "train_configs/qwen3_moe_omni_debug.toml", 2, 1024,
              ("--omni.llm_layers", "1") + LLAMA_DATA + _ep(2) + _cap(1.25), steps=4, warmup=1),
    ],
}

STEP_LINE = re.compile(
    r"step:\s*(\d+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+).*?tflops:\s*([\d,.]+).*?mfu:\s*([\d.]+)%"
)
ANSI = re.compile(r"\x1b\[[0-9;]*m")
MOE_FIELD = re.compile(r"moe: max/mean ([\d.]+) \(layer \d+\) dropped [\d,]+ \(([\d.]+)%\)")


def parse_steps(log: str) -> list[dict]:
    """The per-step metrics of a TorchTitan (stock or omni) log."""
    out = []
    for line in ANSI.sub("", log).splitlines():
        m = STEP_LINE.search(line)
        if m:
            step = {"step": int(m[1]), "mem_gib": float(m[2]), "tps": float(m[3].replace(",", "")),
                    "tflops": float(m[4].replace(",", "")), "mfu": float(m[5])}
            moe = MOE_FIELD.search(line)
            if moe:
                step.update(max_over_mean=float(moe[1]), dropped_pct=float(moe[2]))
            out.append(step)
    return out


def titan_flops_per_token(point: Point) -> float:
    """TorchTitan's per-token training FLOPs of the point's LLM at its sequence length."""
    import torch

    import torchtitan_omni.models  # noqa: F401  (registers the specs)
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_omni.config.manager import parse_job_config

    if point.stock:
        spec = get_train_spec("llama3")
        args = spec.model_args[point.config]
    else:
        os.environ["WORLD_SIZE"] = str(point.ngpu)  # what the config is validated against
        cfg = parse_job_config(["--job.config_file", point.config, *point.args,
                                "--training.seq_len", str(point.seq_len)])
        spec = get_train_spec(cfg.model.name)
        args = spec.model_args[cfg.model.flavor]
        args.update_from_config(cfg)  # applies omni.llm_layers
    with torch.device("meta"):
        model = spec.model_cls(args)
    _, flops = args.get_nparams_and_flops(model, point.seq_len)
    return float(flops)


def summarize(point: Point, steps: list[dict], wall_s: float, rc: int) -> dict:
    row = {"name": point.name, "ngpu": point.ngpu, "seq_len": point.seq_len, "rc": rc,
           "wall_s": round(wall_s), "command": point.shell(), "steps_logged": len(steps)}
    timed = [s for s in steps if s["step"] > point.warmup]
    if not timed:
        return row
    tps = statistics.median(s["tps"] for s in timed)
    mfu = statistics.median(s["mfu"] for s in timed)
    tflops = statistics.median(s["tflops"] for s in timed)
    row.update(tps=tps, mfu=mfu, mem_gib=max(s["mem_gib"] for s in steps))
    if all("dropped_pct" in s for s in timed):
        row.update(max_over_mean=statistics.median(s["max_over_mean"] for s in timed),
                   dropped_pct=statistics.median(s["dropped_pct"] for s in timed))
    if mfu > 0 and tflops > 0:
        peak = tflops * 1e12 / (mfu / 100)
        row["mfu_titan"] = 100 * tps * titan_flops_per_token(point) / peak
    return row


def prepare_data(points: list[Point]) -> None:
    """Long-context datasets for the omni points (built in parallel once the bundled dataset
    exists), bundled text for the stock ones."""
    builds = {}
    for point in points:
        if point.dataset() != STOCK_TEXT and not os.path.exists(os.path.join(REPO, point.dataset(), "train.jsonl")):
            builds.setdefault(point.dataset(), [
                sys.executable, "scripts/build_long_context_dataset.py", "--config", point.config,
                "--seq-len", str(point.seq_len), "--out", point.dataset(),
                "--rows", "16" if point.seq_len <= 32768 else "8"])
    commands = list(builds.values())
    if commands:  # the first one builds the bundled dataset if needed
        subprocess.run(commands[0], cwd=REPO, check=True)
    procs = [subprocess.Popen(c, cwd=REPO) for c in commands[1:]]
    if any(p.wait() for p in procs):
        raise SystemExit("building a long-context dataset failed (see above)")
    if any(p.dataset() == STOCK_TEXT for p in points):
        if not commands:  # the bundled dataset itself
            subprocess.run([sys.executable, "-c", "from torchtitan_omni.data.default_dataset import "
                            "ensure_default_dataset as e; e(tokenizer_dir='assets/tokenizer')"], cwd=REPO, check=True)
        os.makedirs(os.path.join(REPO, STOCK_TEXT), exist_ok=True)
        src = os.path.join(REPO, "data/omni_default/train-text.jsonl")
        with open(src) as f, open(os.path.join(REPO, STOCK_TEXT, "train.jsonl"), "w") as g:
            g.write(f.read())


def table(rows: list[dict], device: str) -> str:
    lines = [
        f"Device: {device}. tokens/s/GPU and MFU: medians over the steps after warm-up; memory: "
        "peak reserved.",
        "",
        "| point | GPUs | seq | tokens/s/GPU | MFU (model FLOPs) | MFU (TorchTitan formula) | peak mem (GiB) | status |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "tps" in r:
            status = "ok" if r["rc"] == 0 else r.get("status", f"exit {r['rc']}")
            mt = f"{r['mfu_titan']:.1f}%" if "mfu_titan" in r else "-"
            lines.append(f"| {r['name']} | {r['ngpu']} | {r['seq_len'] // 1024}K | {r['tps']:,.0f} | "
                         f"{r['mfu']:.1f}% | {mt} | {r['mem_gib']:.1f} | {status} |")
        else:
            lines.append(f"| {r['name']} | {r['ngpu']} | {r['seq_len'] // 1024}K | - | - | - | - | "
                         f"{r.get('status', 'exit %s' % r.get('rc'))} |")
    moe = [r for r in rows if "dropped_pct" in r]
    if moe:
        lines += ["", "| point | MoE worst layer max/mean tokens per expert | copies dropped |",
                  "| --- | --- | --- |"]
        lines += [f"| {r['name']} | {r['max_over_mean']:.2f} | {r['dropped_pct']:.2f}% |"
                  for r in moe]
    lines += ["", "Commands:", ""]
    lines += [f"- `{r['name']}`: `{r['command']}`" for r in rows]
    return "\n".join(lines) + "\n"


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}, torch {torch.__version__}"
    return f"CPU (gloo), torch {torch.__version__}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plan", choices=sorted(PLANS), required=True)
    p.add_argument("--only", default="", help="comma-separated point names (default: all)")
    p.add_argument("--out", required=True, help="markdown table (a .json file goes beside it)")
    p.add_argument("--logs", default="", help="folder for each point's full log")
    p.add_argument("--deadline", type=float, default=0, help="seconds; skip points that would not fit")
    p.add_argument("--extra", default="", help="arguments appended to every point (e.g. profiling)")
    args = p.parse_args()

    start = time.monotonic()
    points = [pt for pt in PLANS[args.plan] if not args.only or pt.name in args.only.split(",")]
    if args.extra:
        points = [dataclasses.replace(pt, args=pt.args + tuple(shlex.split(args.extra))) for pt in points]
    prepare_data(points)
    rows = []
    for point in points:
        left = args.deadline - (time.monotonic() - start) if args.deadline else None
        if left is not None and left < point.estimate_s:
            rows.append({"name": point.name, "ngpu": point.ngpu, "seq_len": point.seq_len,
                         "command": point.shell(), "status": "not run (deadline)"})
            continue
        t0 = time.monotonic()
        # own process group: a point past the deadline is stopped with torchrun's workers
        proc = subprocess.Popen(point.command(), cwd=REPO, env={**os.environ, **point.environment()},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            log, rc = proc.communicate(timeout=left)[0], proc.returncode
        except subprocess.TimeoutExpired:
            # SIGTERM first: torchrun then stops its workers (they run in sessions of their own)
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                log = proc.communicate(timeout=30)[0]
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                log = proc.communicate()[0]
            rc = "timeout"
        if args.logs:
            os.makedirs(args.logs, exist_ok=True)
            with open(os.path.join(args.logs, f"{point.name}.log"), "w") as f:
                f.write(log)
        row = summarize(point, parse_steps(log), time.monotonic() - t0, rc)
        if rc != 0:
            oom = "out of memory" in log.lower() or "OutOfMemoryError" in log
            row["status"] = "OOM" if oom else (rc if rc == "timeout" else f"exit {rc}")
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)

    text = table(rows, device_name())
    with open(args.out, "w") as f:
        f.write(text)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
