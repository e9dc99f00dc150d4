"""Throughput, MFU and peak memory of real-size training runs, one ``run_train.sh`` per point.

Each point of a plan is a full training job (the real trainer, data pipeline and
parallelism; random weights) on one of four workloads, built before the points run by
``scripts/build_long_context_dataset.py`` (one document per row, so attention spans the whole
sequence):

- ``realistic``: images of 448-1,024 px, clips of 16-32 frames, 10-30 s of speech, about half
  of each row's tokens (images, video and audio);
- ``toy``: the bundled dataset's thumbnails (48 px images, 8-frame 32 px clips), under 1% of
  the tokens (images and video);
- ``long_text``: the same paragraphs in documents of the same length, without media: the
  text baseline of the media rows (their attention spans the whole row too);
- ``text``: the bundled text, packed (stock TorchTitan's data, for the omni text-only point):
  short documents, so its attention costs far less than the rows above' (by the trainer's
  FLOP count, the toy 8K rows carry 1.40x its FLOPs per token on the MoE 12-layer cut, 1.14x
  on LLaMA#Omni 8B).

A plan may hold stock TorchTitan 0.2.2 (Llama-3 on the bundled text) and the omni trainer on
the same text as baselines of the same call. For each point it reads the per-step log lines
and reports, over the steps after ``warmup``: the median tokens/s per GPU (every real LLM
position, media placeholders included, as the trainer counts them), its ratio to the stock,
text-only and long-text points of the same GPUs, sequence length, compile setting and linears'
precision (bf16 or float8), the MFU by the trainer's model-FLOP count (causal attention by
real document lengths, encoders included), the MFU by TorchTitan's formula (``6 x
non-embedding params + 12 x layers x heads x head_dim x seq_len`` per token, what stock runs
print), the median step time (the omni lines' own, else between consecutive step lines), the
peak reserved memory (and the peak active, where the omni trainer logs it) and, for
``torch.compile`` points (run with
``TORCH_LOGS=recompiles``), the recompilations rank 0 logged. Results go to a markdown table
(with the exact command of each point) and a JSON file.

    python3 scripts/bench_scaling.py --plan omni_1gpu --out bench_1gpu.md --logs bench_logs
    python3 scripts/bench_scaling.py --plan omni_2gpu --no-compile --out bench_2gpu.md
    python3 scripts/bench_scaling.py --plan smoke_cpu --out /tmp/smoke.md   # CPU, tiny models

``--deadline`` (seconds) skips the points that would not finish in time, by their estimates;
``--no-compile`` / ``--compile-only`` drop or keep only the ``torch.compile`` points.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from unittest import mock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STOCK_TEXT = "data/stock_text"
WORKLOADS = ("realistic", "toy", "long_text", "text")
# the cut 8B flavors of stock TorchTitan (scripts/titan_flavors.py)
FLAVORS_MODULE = "scripts.titan_flavors"
# the omni benchmark flavors (scripts/omni_flavors.py), as the trainer imports them
OMNI_FLAVORS = ("--experimental.custom_import", "scripts.omni_flavors")
LAYER_CUTS = (4, 8, 12, 16, 20, 24, 28)
COMPILE_COMPONENTS = "model,loss"
# Realistic media cost the loader ~0.5 s of CPU per 8K row: the omni default
# (training.dataloader.num_workers = -1) decodes them in loader workers on GPU runs.
# Rows are single documents, so a small buffer packs them alike and starts faster.
LONG_DOCS = ("--data.buffer_docs", "4")
MODALITIES = {"realistic": ("--data.modalities", "image,video,audio"),
              "toy": ("--data.modalities", "image,video"), "long_text": (), "text": ()}
#: the builder's workload of each built one (scripts/build_long_context_dataset.py)
BUILT = {"realistic": "realistic", "toy": "toy", "long_text": "text"}
#: where each built workload's datasets go, under data/
FOLDERS = {"realistic": "realistic", "toy": "long_context", "long_text": "long_text"}


@dataclass
class Point:
    """One training job of a plan."""

    name: str
    config: str  # omni TOML, or the llama3 flavor of a stock point
    ngpu: int
    seq_len: int
    args: tuple[str, ...] = ()
    steps: int = 10
    warmup: int = 3
    estimate_s: int = 90  # for --deadline
    stock: bool = False  # stock TorchTitan (torchtitan.train, Llama-3), else run_train.sh
    workload: str = "toy"  # one of WORKLOADS (stock points: text)
    compile: bool = False  # torch.compile (compile_components), TORCH_LOGS=recompiles
    compile_components: str = COMPILE_COMPONENTS  # with compile: compile.components
    env: dict[str, str] = field(default_factory=dict)
    build_args: tuple[str, ...] = ()  # extra arguments of its dataset's builder
    # non-colocated encoders: these encoders on ranks 0..encoder_ranks-1, the LLM on the rest
    encoder_ranks: int = 0
    encoders: tuple[str, ...] = ("vision", "audio")

    def __post_init__(self) -> None:
        if self.stock:
            self.workload = "text"
        if self.workload not in WORKLOADS:
            raise ValueError(f"point {self.name}: unknown workload {self.workload!r}")

    def dataset(self) -> str:
        if self.workload == "text":
            return STOCK_TEXT
        # per config: media token counts (and so what fits) depend on the model's processors
        stem = os.path.splitext(os.path.basename(self.config))[0]
        return f"data/{FOLDERS[self.workload]}/{stem}_{self.seq_len // 1024}k"

    def build_command(self) -> list[str]:
        """The builder call of this point's dataset (not for the text workload)."""
        return [sys.executable, "scripts/build_long_context_dataset.py", "--config", self.config,
                "--seq-len", str(self.seq_len), "--out", self.dataset(), "--workload",
                BUILT[self.workload], "--rows", "16" if self.seq_len <= 32768 else "8", "--quiet",
                *self.build_args]

    def compile_args(self) -> list[str]:
        """The trainer's ``torch.compile`` flags of the point (none if it runs eagerly)."""
        if not self.compile:
            return []
        return ["--compile.enable", "--compile.components", self.compile_components]

    def command(self) -> list[str]:
        # The LR warm-up is cut to the run's length (TorchTitan would do the same; torchtitan-omni
        # refuses a warm-up longer than the schedule): the same learning rates either way.
        common = ["--training.seq_len", str(self.seq_len), "--training.steps", str(self.steps),
                  "--lr_scheduler.warmup_steps", str(self.steps),
                  "--metrics.log_freq", "1", "--training.local_batch_size", "1"]
        extra = [*self.args, *self.compile_args()]
        if self.stock:
            return ["torchrun", f"--nproc_per_node={self.ngpu}", "--rdzv_backend", "c10d",
                    "--rdzv_endpoint=localhost:0", "--local-ranks-filter", "0", "--role", "rank",
                    "--tee", "3", "-m", "torchtitan.train",
                    "--experimental.custom_import", FLAVORS_MODULE, "--model.name", "llama3",
                    "--model.flavor", self.config, "--model.hf_assets_path", "assets/tokenizer",
                    "--training.dataset", "c4_test", "--training.dataset_path", self.dataset(),
                    "--job.dump_folder", f"outputs/bench_{self.name}", *common, *extra]
        data = [*MODALITIES[self.workload]]
        if self.workload != "text":
            data += LONG_DOCS
        return ["./run_train.sh", "--training.dataset", "long_context", "--training.dataset_path",
                self.dataset(), "--job.dump_folder", f"outputs/bench_{self.name}",
                "--checkpoint.no-enable", "--metrics.no-enable_tensorboard",
                *common, *data, *extra]

    def environment(self) -> dict[str, str]:
        env = {"NGPU": str(self.ngpu), **self.env}
        if self.compile:
            env.setdefault("TORCH_LOGS", "recompiles")
        if not self.stock:
            env["CONFIG_FILE"] = self.config_file()
        if self.encoder_ranks:
            env["LOG_RANK"] = str(self.encoder_ranks)  # the first LLM rank: its memory
        return env

    def config_file(self) -> str:
        """The TOML the point runs: its config, or for non-colocated encoders a copy of it
        (under outputs/bench_configs/) with each encoder's ``ranks`` table added."""
        if not self.encoder_ranks:
            return self.config
        ranks = list(range(self.encoder_ranks))
        tables = "".join(f'\n[parallelism.parts."encoders.{name}"]\nranks = {ranks}\n'
                         for name in self.encoders)
        path = os.path.join("outputs", "bench_configs", f"{self.name}.toml")
        os.makedirs(os.path.join(REPO, os.path.dirname(path)), exist_ok=True)
        with open(os.path.join(REPO, self.config)) as f:
            base = f.read()
        with open(os.path.join(REPO, path), "w") as f:
            f.write(base + tables)
        return path

    def gpu_share(self) -> float:
        """The share of the GPUs whose log line the point reads: the LLM ranks' line counts
        their tokens and FLOPs only, so a per-GPU figure over every GPU scales by it."""
        return (self.ngpu - self.encoder_ranks) / self.ngpu

    def shell(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.environment().items())
        return f"{env} {shlex.join(self.command())}"


LLAMA8B = "train_configs/llama_omni_8B.toml"
MOE = "train_configs/qwen3_moe_omni_30B_A3B.toml"
LLAMA_DEBUG = "train_configs/llama_omni_debug.toml"
MOE_DEBUG = "train_configs/qwen3_moe_omni_debug.toml"
SEL = ("--activation_checkpoint.mode", "selective",
       "--activation_checkpoint.selective_ac_option", "op")
FULL = ("--activation_checkpoint.mode", "full")


def _layers(n: int) -> tuple[str, ...]:
    return ("--omni.llm_layers", str(n))


def _sp(n: int) -> tuple[str, ...]:
    # each SP rank encodes a share of the media items (not all of them)
    return ("--parallelism.ulysses_degree", str(n),
            "--parallelism.encoder_sequence_parallel", "split")


def _cap(factor: float) -> tuple[str, ...]:
    # capacity-padded expert dispatch (0: exact uneven all-to-all)
    return ("--parallelism.expert_capacity_factor", str(factor))


def _chunks(n: int) -> tuple[str, ...]:
    # capacity-padded EP exchange in n chunks overlapped with the experts
    return ("--parallelism.expert_dispatch_chunks", str(n))


def _ep(n: int) -> tuple[str, ...]:
    return ("--parallelism.expert_parallel_degree", str(n))


#: exact EP dispatch sending each token once per rank (not every routed copy)
TOKENS = ("--parallelism.expert_dispatch", "tokens")
#: the exact dispatch gathering the group's tokens (no host read per layer, fixed shapes)
GATHER = ("--parallelism.expert_dispatch", "gather")
NVSHMEM = ("--parallelism.expert_exchange", "nvshmem")
#: the encoders and decoders replicated on every rank (no FSDP of their own)
REPLICATED = ("--parallelism.encoder_fsdp_mesh", "none")
#: each encoder block its own FSDP unit (the default before 2026-11-26: each encoder one unit)
BLOCK_UNITS = ("--parallelism.encoder_fsdp_unit", "block")
NO_ENCODER_AC = ("--omni.encoder_activation_checkpoint", "none")
#: per-op encoder AC: the blocks keep their matmul and attention outputs and recompute the
#: rest (full encoder AC re-runs every encoder forward in the backward; none holds it all)
OP_ENCODER_AC = ("--omni.encoder_activation_checkpoint", "op")
#: a log line every 10 steps (TorchTitan's default) instead of every step
LOG10 = ("--metrics.log_freq", "10")
# encoder AC on every call, small ones too (the configs exempt calls under 1,024 rows)
EVERY_ENCODER_CALL_AC = ("--omni.encoder_checkpoint_min_tokens", "0")
KEEP_EXCHANGES = ("--parallelism.expert_ac_keep_exchanges",)  # AC around the EP exchanges
#: float8 linears (TorchTitan's converter, tensorwise scales) with FSDP's float8 all-gather and
#: the scales precomputed after the optimizer step: TorchTitan's recommended float8 setting
FLOAT8 = ("--model.converters", "quantize.linear.float8",
          "--quantize.linear.float8.enable_fsdp_float8_all_gather",
          "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp")
NO_AC = ("--activation_checkpoint.mode", "none")
#: with FLOAT8: the encoders' linears in float8 too
FLOAT8_ENCODERS = ("--omni.float8_encoders",)
#: every encoder pass's media items spread over all ranks by estimated cost
BALANCE = ("--parallelism.encoder_sequence_parallel", "balance")
#: the encoders by increasing work of the step's media (audio first on the realistic rows)
#: instead of in the model's order (vision, then audio)
WORK_ORDER = ("--omni.encoder_order", "work")
#: two micro-batches of one row per rank and step on 2 GPUs (gradient accumulation): the
#: optimizer step and the step's edges once per two rows
ACCUM2_2GPU = ("--training.global_batch_size", "4")
#: encoder calls of under 8,192 rows run without activation checkpointing (configs: 1,024)
AC_MIN_8K = ("--omni.encoder_checkpoint_min_tokens", "8192")
#: every FSDP unit stays gathered from its forward to its backward (no re-gather in the
#: backward; the unsharded parameters held meanwhile)
RESHARD_NEVER = ("--parallelism.fsdp_reshard_after_forward", "never")
#: every FSDP unit resharded after its forward (the LLM head too; "default" keeps it gathered)
RESHARD_ALWAYS = ("--parallelism.fsdp_reshard_after_forward", "always")


def compiled(point: Point, estimate_s: int = 60) -> Point:
    """The ``torch.compile`` variant of a point (compilation adds to its run time)."""
    return dataclasses.replace(point, name=f"{point.name}_compile", compile=True,
                               estimate_s=point.estimate_s + estimate_s)


def with_compiled_optimizer(point: Point) -> Point:
    """A compiled point with the optimizer's update of large tensors compiled too
    (``compile.components`` with ``"optimizer"``: components/adam_update.py)."""
    if not point.compile:
        raise ValueError(f"point {point.name}: not compiled")
    return dataclasses.replace(point, name=f"{point.name}_opt",
                               compile_components=f"{point.compile_components},optimizer")


#: the experts read bf16 copies of their weights that the optimizer keeps
COMPUTE_COPIES = ("--parallelism.expert_compute_copies",)


def with_compute_copies(point: Point) -> Point:
    """A MoE point whose experts read the compute copies the optimizer keeps
    (``parallelism.expert_compute_copies``: components/compute_copies.py)."""
    return dataclasses.replace(point, name=f"{point.name}_cc", args=point.args + COMPUTE_COPIES)


#: AdamW's moments of the compiled update's tensors in bf16, rounded stochastically
BF16_MOMENTS = ("--optimizer.moments_dtype", "bfloat16")


def with_bf16_moments(point: Point) -> Point:
    """A point with the optimizer's update compiled whose moments are kept in bf16
    (``optimizer.moments_dtype``: components/adam_update.py)."""
    if not point.compile_components.endswith("optimizer"):
        raise ValueError(f"point {point.name}: the optimizer's update is not compiled")
    return dataclasses.replace(point, name=f"{point.name}_m16", args=point.args + BF16_MOMENTS)


#: the experts' weights stored in bf16, updated in float32 and rounded stochastically
BF16_EXPERT_WEIGHTS = ("--optimizer.expert_weights_dtype", "bfloat16")


def with_bf16_expert_weights(point: Point) -> Point:
    """A MoE point with the optimizer's update compiled whose experts store their weights in
    bf16 (``optimizer.expert_weights_dtype``: components/expert_weights.py); no compute
    copies (nothing left to copy)."""
    if not point.compile_components.endswith("optimizer") or COMPUTE_COPIES[0] in point.args:
        raise ValueError(f"point {point.name}: needs the compiled update and no compute copies")
    return dataclasses.replace(point, name=f"{point.name}_w16",
                               args=point.args + BF16_EXPERT_WEIGHTS)


def omni_1gpu(layers: int = 16) -> list[Point]:
    """One GPU, the 8B layer shape cut to ``layers`` LLM layers (full vision tower): stock
    TorchTitan, omni text-only, realistic and toy at 8K; then each compiled; the realistic
    rows compiled with the encoders by increasing work; text-only and realistic compiled with
    the optimizer's update compiled too."""
    cut, stem = _layers(layers), f"8B_{layers}L"
    eager = [
        Point(f"stock_llama3_{stem}_8k", f"8B_{layers}L", 1, 8192, SEL, stock=True, estimate_s=70),
        Point(f"omni_{stem}_8k_text_only", LLAMA8B, 1, 8192, cut + SEL, workload="text",
              estimate_s=80),
        Point(f"omni_{stem}_8k_realistic", LLAMA8B, 1, 8192, cut + SEL, workload="realistic",
              estimate_s=90),
        Point(f"omni_{stem}_8k_toy", LLAMA8B, 1, 8192, cut + SEL, workload="toy", estimate_s=80),
    ]
    # the realistic rows compiled with the encoders by increasing work (audio first) instead of
    # in the model's order
    realistic = compiled(eager[2])
    work_order = dataclasses.replace(realistic, name=f"{realistic.name}_work_order",
                                     args=realistic.args + WORK_ORDER)
    optimizer = [with_compiled_optimizer(compiled(p)) for p in eager[1:3]]
    return eager + [compiled(p) for p in eager] + optimizer + [work_order]


def omni_2gpu() -> list[Point]:
    """Two GPUs, full 8B, FSDP2: stock, text-only, realistic and toy at 8K (toy and realistic
    also with each encoder block an FSDP unit), realistic at 32K
    with Ulysses SP2, the toy rows logging every 10 steps (also with the encoders replicated);
    then the 8K points compiled; last 64K, and 128K with the offloads."""
    eager = [
        Point("stock_llama3_8B_8k_fsdp2", "8B", 2, 8192, SEL, stock=True, estimate_s=80),
        Point("omni_8B_8k_text_only", LLAMA8B, 2, 8192, SEL, workload="text", estimate_s=90),
        Point("omni_8B_8k_long_text", LLAMA8B, 2, 8192, SEL, workload="long_text", estimate_s=90),
        # the 16 realistic rows make 8 steps on 2 GPUs: one pass of warm-up (compiled, every
        # row's media shapes seen), two passes timed (each row weighs the same in the median;
        # 10 steps left recompiles and an uneven share of rows in it)
        Point("omni_8B_8k_realistic", LLAMA8B, 2, 8192, SEL, steps=24, warmup=8,
              workload="realistic", estimate_s=120),
        Point("omni_8B_8k_toy", LLAMA8B, 2, 8192, SEL, workload="toy", estimate_s=90),
        # logging every 10 steps (TorchTitan's default; the points above log every step, and
        # each logged step makes the host wait for the GPU at its end): whether the next step's
        # launch-bound encoder phase can be queued behind the GPU's work
        *[Point(f"omni_8B_8k_{workload}_log10", LLAMA8B, 2, 8192, SEL + LOG10, steps=30,
                warmup=10, workload=workload, estimate_s=90)
          for workload in ("long_text", "toy")],
        # the toy rows with the encoders replicated (no FSDP all-gather or reduce-scatter of
        # the vision tower, whose post-backward reduction left the GPU idle 26 ms in the
        # sixth session's profile): what the encoders' own FSDP costs on 2 GPUs
        Point("omni_8B_8k_toy_log10_encoders_replicated", LLAMA8B, 2, 8192,
              SEL + LOG10 + REPLICATED, steps=30, warmup=10, workload="toy", estimate_s=90),
        # each encoder block an FSDP unit (parallelism.encoder_fsdp_unit "block")
        Point("omni_8B_8k_toy_encoder_unit_block", LLAMA8B, 2, 8192, SEL + BLOCK_UNITS,
              workload="toy", estimate_s=90),
        Point("omni_8B_8k_realistic_encoder_unit_block", LLAMA8B, 2, 8192, SEL + BLOCK_UNITS,
              workload="realistic", estimate_s=100),
        # the realistic rows with per-op encoder AC (the encoders' recompute is most of what
        # full encoder AC costs there; H200s have the memory it takes)
        Point("omni_8B_8k_realistic_encoder_ac_op", LLAMA8B, 2, 8192, SEL + OP_ENCODER_AC,
              workload="realistic", estimate_s=100),
    ]
    # full AC: 16K tokens per rank next to 71 GiB of sharded fp32 states and AdamW moments
    long = Point("omni_8B_32k_sp2_full_ac_realistic", LLAMA8B, 2, 32768, FULL + _sp(2),
                 steps=6, warmup=2, workload="realistic", estimate_s=120)
    # the longest rows: 64K (the >= 50% MFU target), 128K with the LLM blocks' saved
    # activations in host memory and FSDP's CPU offload of parameters and optimizer state
    longer = [
        Point("omni_8B_64k_sp2_full_ac_realistic", LLAMA8B, 2, 65536, FULL + _sp(2), steps=5,
              warmup=2, workload="realistic", estimate_s=150),
        Point("omni_8B_128k_sp2_full_ac_offload_realistic", LLAMA8B, 2, 131072,
              FULL + _sp(2) + ("--omni.activation_offload", "--training.enable_cpu_offload"),
              steps=4, warmup=2, workload="realistic", estimate_s=240),
    ]
    # float8 linears next to the bf16 compiled points (stock, text-only, realistic rows): the
    # 2-GPU pairs of float8_points, on the same compiled points as above; and the long text
    # (one 7.8K document a row, no media): the LLM alone on rows of the realistic rows' shape,
    # the ceiling their MFU approaches when the encoders run as fast as the LLM
    float8 = [as_float8(compiled(p))
              for p in eager if p.name in ("stock_llama3_8B_8k_fsdp2", "omni_8B_8k_text_only",
                                           "omni_8B_8k_long_text", "omni_8B_8k_realistic")]
    # the realistic rows' float8 point (47.5% model-FLOPs MFU over 24 steps, thirteenth
    # session) with the encoders' media items balanced over the ranks, without encoder AC,
    # with the encoders' linears in float8 too (also with per-op or no encoder AC): what the
    # encoders' skew between ranks, recompute and bf16 matmuls still cost against the 55%
    # target
    realistic = float8[-1]
    float8 += [dataclasses.replace(realistic, name=f"{realistic.name}_{tag}",
                                   args=realistic.args + flags)
               for tag, flags in (("balance", BALANCE), ("no_encoder_ac", NO_ENCODER_AC),
                                  ("encoders", FLOAT8_ENCODERS),
                                  ("encoders_encoder_ac_op", FLOAT8_ENCODERS + OP_ENCODER_AC),
                                  ("encoders_no_encoder_ac", FLOAT8_ENCODERS + NO_ENCODER_AC))]
    # two rows per rank and step: 12 steps are the same 24 rows a rank reads in 24 steps
    # above, 4 of them warm-up (one pass over the 16 rows)
    float8.append(dataclasses.replace(realistic, name=f"{realistic.name}_accum2",
                                      args=realistic.args + ACCUM2_2GPU, steps=12, warmup=4))
    # the same logging every 8 steps, one pass over the 16 rows per line: the points above log
    # every step, and each log line makes the host wait for the GPU (the fourteenth session's
    # trace: a rank's GPU idles 63 and 24 ms after its step's two host reads)
    float8.append(dataclasses.replace(realistic, name=f"{realistic.name}_log8",
                                      args=realistic.args + ("--metrics.log_freq", "8"),
                                      steps=32, warmup=8, estimate_s=150))
    # the audio tower unchecked: its calls (under 3,000 rows on these rows) fall below the
    # threshold, the vision tower's (over 11,000) stay checkpointed; the audio tower's GPU work
    # is small next to its host time, and the recompute adds a third forward's launches
    float8.append(dataclasses.replace(realistic, name=f"{realistic.name}_ac_min8k",
                                      args=realistic.args + AC_MIN_8K))
    # per-op encoder AC: the encoders' matmul and attention outputs kept, only their elementwise
    # ops recomputed (the encoders' added work runs at about 31% MFU under full AC, nineteenth
    # session)
    float8.append(dataclasses.replace(realistic, name=f"{realistic.name}_encoder_ac_op",
                                      args=realistic.args + OP_ENCODER_AC))
    # no FSDP unit resharded after its forward: the backward gathers nothing (half the
    # all-gathers of the step, each a point where one rank waits for the other's media work),
    # for the LLM's float8 weights held from forward to backward (about 7 GiB on 2 GPUs); the
    # long text alike (the LLM alone), and with every unit resharded (the LLM head too)
    long_text = next(p for p in float8 if p.name == "omni_8B_8k_long_text_compile_float8")
    float8 += [dataclasses.replace(p, name=f"{p.name}_{tag}", args=p.args + flags)
               for p in (realistic, long_text)
               for tag, flags in (("reshard_never", RESHARD_NEVER),
                                  ("reshard_always", RESHARD_ALWAYS))]
    # ... with per-op encoder AC too (each 1.08x and 1.04x alone, twentieth session), with
    # the audio tower unchecked (no compile stalls, nineteenth session), and with the items
    # balanced over the ranks by their FLOPs across the forward's passes (the metadata agreed
    # on the hosts through gloo: before, an NCCL round trip drained the GPU's queue each pass),
    # and with the encoders by increasing work (the lightest, launch-bound one first)
    float8 += [dataclasses.replace(realistic, name=f"{realistic.name}_reshard_never_{tag}",
                                   args=realistic.args + RESHARD_NEVER + flags)
               for tag, flags in (("encoder_ac_op", OP_ENCODER_AC), ("ac_min8k", AC_MIN_8K),
                                  ("balance", BALANCE), ("work_order", WORK_ORDER))]
    # ... over 64 steps, the first 32 warm-up: an encoder GEMM of a row count not seen before
    # can pick a cuBLAS kernel the driver has not loaded yet, and the load held rank 0's host
    # 194 ms in step 20 (twenty-third session); the kernels in use settle as a run goes on, so
    # the later steps are the steady state a long run sees. And with every kernel loaded at
    # start-up (CUDA_MODULE_LOADING=EAGER: 1.00x in one call, not profiled)
    never = next(p for p in float8 if p.name == f"{realistic.name}_reshard_never")
    float8 += [dataclasses.replace(never, name=f"{never.name}_steps64", steps=64, warmup=32,
                                   estimate_s=240),
               dataclasses.replace(never, name=f"{never.name}_eager_loading",
                                   env={**never.env, "CUDA_MODULE_LOADING": "EAGER"})]
    # two rows per GPU a step (every unit resharded: 130 of 141 GiB on H200s): each encoder
    # call, FSDP gather and optimizer step serves twice the tokens (56.3% MFU against 48.5%
    # with one row on the same machine, twenty-fourth session)
    float8.append(dataclasses.replace(realistic, name=f"{realistic.name}_batch2",
                                      args=realistic.args + ("--training.local_batch_size", "2"),
                                      estimate_s=240))
    return eager + [long] + [compiled(p) for p in eager] + longer + float8


def llama_4gpu() -> list[Point]:
    """LLaMA#Omni 8B, FSDP + Ulysses on 4 GPUs: realistic rows first, toy rows second; long
    text and toy rows logging every 10 steps (the toy rows also with the encoders replicated);
    the float8 realistic rows at 8K and 64K also with no FSDP unit resharded."""
    points = [
        Point("stock_llama3_8B_8k_fsdp4", "8B", 4, 8192, SEL, steps=12, stock=True, estimate_s=70),
        Point("omni_8B_8k_sp1_realistic", LLAMA8B, 4, 8192, SEL, steps=12, workload="realistic",
              estimate_s=90),
        Point("omni_8B_8k_sp1_toy", LLAMA8B, 4, 8192, SEL, steps=12, estimate_s=80),
        # the omni model on the stock run's text: the LLM path alone (every part skipped), and
        # on text in documents as long as the media rows' (their attention costs)
        Point("omni_8B_8k_text_only", LLAMA8B, 4, 8192, SEL, steps=12, workload="text",
              estimate_s=70),
        Point("omni_8B_8k_long_text", LLAMA8B, 4, 8192, SEL, steps=12, workload="long_text",
              estimate_s=75),
        Point("omni_8B_32k_sp4_realistic", LLAMA8B, 4, 32768, SEL + _sp(4), steps=8,
              workload="realistic", estimate_s=100),
        Point("omni_8B_128k_sp4_full_ac_realistic", LLAMA8B, 4, 131072, FULL + _sp(4), steps=5,
              warmup=2, workload="realistic", estimate_s=180),
        Point("omni_8B_64k_sp4_full_ac_realistic", LLAMA8B, 4, 65536, FULL + _sp(4), steps=6,
              warmup=2, workload="realistic", estimate_s=110),
        Point("omni_8B_16k_sp2_realistic", LLAMA8B, 4, 16384, SEL + _sp(2), steps=8,
              workload="realistic", estimate_s=90),
        # 64K without full AC (its recompute is a third more work that MFU does not count):
        # selective per-op AC, and every 2nd block checkpointed; 16K tokens' activations per
        # rank, so 4x H200 (141 GB) only
        Point("omni_8B_64k_sp4_realistic", LLAMA8B, 4, 65536, SEL + _sp(4), steps=6, warmup=2,
              workload="realistic", estimate_s=110),
        Point("omni_8B_64k_sp4_ac2_realistic", LLAMA8B, 4, 65536,
              ("--activation_checkpoint.mode", "selective",
               "--activation_checkpoint.selective_ac_option", "2") + _sp(4), steps=6, warmup=2,
              workload="realistic", estimate_s=110),
        # the selective-AC 64K point compiled, in bf16 and with float8 linears (4x H200: 40.9%
        # model-FLOPs MFU eager, eleventh session; compiling took the 8K realistic rows from
        # 29.6% to 39.1% on 2x H200)
        *with_float8(compiled(Point("omni_8B_64k_sp4_realistic", LLAMA8B, 4, 65536,
                                    SEL + _sp(4), steps=8, warmup=3, workload="realistic",
                                    estimate_s=110), 90)),
        # ... and without any LLM AC (no recompute at all: float8 gave 49.2-49.5% with per-op
        # AC at 95.8 GiB, fifteenth session; full AC peaked at 68.9 and every second block at
        # 95.1, so about 125 GiB is expected)
        *with_float8(compiled(Point("omni_8B_64k_sp4_no_ac_realistic", LLAMA8B, 4, 65536,
                                    NO_AC + _sp(4), steps=8, warmup=3, workload="realistic",
                                    estimate_s=110), 90)),
        # longer rows in the same layout (float8, per-op AC): attention's share of the step
        # grows with the row, and it ran at about 54% of the bf16 peak at 64K (1.7 of the 3.25 s
        # step, seventeenth session's profile) against about 45% for the rest; 80K and 96K rows
        # put 20K and 24K positions on each GPU (64K peaked at 100 of 141 GiB)
        *[q for k in (80, 96)
          for q in with_float8(compiled(Point(f"omni_8B_{k}k_sp4_realistic", LLAMA8B, 4,
                                              k * 1024, SEL + _sp(4), steps=8, warmup=3,
                                              workload="realistic", estimate_s=50 + k), 90))],
        # a log line every 10 steps (as omni_2gpu's *_log10 points), and the toy rows with
        # the encoders replicated
        *[Point(f"omni_8B_8k_{workload}_log10", LLAMA8B, 4, 8192, SEL + LOG10, steps=30,
                warmup=10, workload=workload, estimate_s=90)
          for workload in ("long_text", "toy")],
        Point("omni_8B_8k_toy_log10_encoders_replicated", LLAMA8B, 4, 8192,
              SEL + LOG10 + REPLICATED, steps=30, warmup=10, workload="toy", estimate_s=90),
        # each encoder block an FSDP unit (parallelism.encoder_fsdp_unit = "block"), and the
        # default (one unit per encoder) without encoder AC, against the same call's default
        *[Point(f"omni_8B_8k_sp1_{workload}_{tag}", LLAMA8B, 4, 8192, SEL + flags, steps=12,
                workload=workload, estimate_s=85)
          for workload in ("toy", "realistic")
          for tag, flags in (("encoder_unit_block", BLOCK_UNITS),
                             ("encoders_no_ac", NO_ENCODER_AC),
                             ("encoder_ac_every_call", EVERY_ENCODER_CALL_AC),
                             ("encoder_ac_op", OP_ENCODER_AC))],
        *float8_points(4),
    ]
    # no FSDP unit resharded after its forward (1.08x on the 2-GPU realistic rows, twentieth
    # session; about 16 GiB more on 4 GPUs: 64K 100.3 -> 116.2 GiB, twenty-first session; 80K
    # peaked at 113.9 GiB resharding)
    return points + [
        dataclasses.replace(p, name=f"{p.name}_reshard_never", args=p.args + RESHARD_NEVER)
        for p in points if p.name in ("omni_8B_8k_fsdp4_realistic_compile_float8",
                                      "omni_8B_64k_sp4_realistic_compile_float8",
                                      "omni_8B_80k_sp4_realistic_compile_float8")]


def float8_points(ngpu: int) -> list[Point]:
    """Float8 linears in the foundation's blocks (compiled, as TorchTitan runs float8), each
    next to the same point compiled in bf16: stock TorchTitan and the omni text-only rows (the
    converter alone), then the realistic rows (model-FLOPs MFU against the bf16 peak: float8 is
    how it can pass stock TorchTitan's bf16 text MFU)."""
    fsdp = f"fsdp{ngpu}"
    pairs = [
        Point(f"stock_llama3_8B_8k_{fsdp}", "8B", ngpu, 8192, SEL, steps=12, stock=True,
              estimate_s=70),
        Point(f"omni_8B_8k_{fsdp}_text_only", LLAMA8B, ngpu, 8192, SEL, steps=12,
              workload="text", estimate_s=80),
        Point(f"omni_8B_8k_{fsdp}_realistic", LLAMA8B, ngpu, 8192, SEL, steps=12,
              workload="realistic", estimate_s=90),
    ]
    return [q for p in pairs for q in with_float8(compiled(p, 70))]


def as_float8(point: Point) -> Point:
    """The float8 variant of a point (``<name>_float8``: :data:`FLOAT8` added)."""
    return dataclasses.replace(point, name=f"{point.name}_float8", args=point.args + FLOAT8)


def with_float8(point: Point) -> list[Point]:
    """A point and its float8 variant (:func:`as_float8`)."""
    return [point, as_float8(point)]


def moe_4gpu() -> list[Point]:
    """Qwen3-MoE#Omni at the 30B-A3B layer shape cut to 12 layers (the VeOmni anchor's cut on
    4x H200), full activation checkpointing, the best dispatcher of ``moe_dispatch_2gpu``
    (capacity 1.25, compiled): text-only, realistic media and 16K text (whether the step scales
    with tokens) at EP4; the exact dispatcher eager (the code before issue 12) as the same
    call's baseline (also at 16K, on the toy rows and on realistic rows at 8K and 32K: capacity
    drops about half the media copies at random init); the exact dispatcher with activation
    checkpointing kept off its exchanges, and sending each token once per rank
    (``expert_dispatch = "tokens"``: text at 8K and 16K, realistic rows at 8K); the exact
    dispatcher compiled on text, toy and realistic rows; the media
    path's encoders replicated, with each block an FSDP unit (``encoder_fsdp_unit = "block"``)
    or not checkpointed, on toy and realistic rows; EP4 with Ulysses SP2 at 32K and SP4 at 64K; EP2
    (experts over 2 ranks, FSDP over 4) at 8K; last long text and toy rows logging every 10
    steps with the NCCL and the NVSHMEM exchange, and the toy rows with the encoders replicated.
    The first point also profiles its last step (host syncs per layer, where the time goes)."""
    cut = _layers(12) + FULL
    best = _cap(1.25)
    profile = ("--profiling.enable_profiling", "--profiling.profile_freq", "10")

    def point(name: str, seq: int, layout: tuple[str, ...], workload: str, **kw) -> Point:
        return compiled(Point(f"moe_30B-A3B_12L_{name}", MOE, 4, seq, cut + layout,
                              workload=workload, estimate_s=80, **kw), 70)

    return [
        point("8k_ep4_text_cap1.25", 8192, _ep(4) + best + profile, "text"),
        point("8k_ep4_realistic_cap1.25", 8192, _ep(4) + best, "realistic"),
        point("16k_ep4_text_cap1.25", 16384, _ep(4) + best, "text", steps=8),
        # the exact dispatcher eager: text at 8K and 16K, toy rows, realistic rows at 8K, 32K
        # (text and toy at 8K profile their last step: where the media path's time goes)
        *[Point(f"moe_30B-A3B_12L_{seq // 1024}k_ep4_{workload}_exact", MOE, 4, seq,
                cut + _ep(4) + (profile if seq == 8192 and workload in ("text", "toy") else ()),
                workload=workload, estimate_s=80)
          for seq, workload in ((8192, "text"), (16384, "text"), (8192, "toy"),
                                (8192, "realistic"), (32768, "realistic"), (8192, "long_text"))],
        Point("moe_30B-A3B_12L_8k_ep4_toy_exact_encoder_ac_every_call", MOE, 4, 8192,
              cut + _ep(4) + EVERY_ENCODER_CALL_AC, workload="toy", estimate_s=80),
        # the exact dispatcher compiled (blocks in pieces at the split-size reads): the
        # encoders' compiled blocks against their eager host time on the toy rows; text at 16K
        # too (the compiled step's fixed part, beside the compiled gather pair)
        *[compiled(Point(f"moe_30B-A3B_12L_{seq // 1024}k_ep4_{workload}_exact", MOE, 4, seq,
                         cut + _ep(4), workload=workload, estimate_s=80), 70)
          for seq, workload in ((8192, "text"), (16384, "text"), (8192, "toy"),
                                (8192, "realistic"), (8192, "long_text"))],
        # full AC around the expert exchanges (no all-to-all in the recompute)
        Point("moe_30B-A3B_12L_8k_ep4_text_exact_keep_exchanges", MOE, 4, 8192,
              cut + _ep(4) + KEEP_EXCHANGES, workload="text",
              estimate_s=80),
        # each token sent once per rank holding one of its experts (about 3.6 rows per token
        # instead of 8 on EP4): text at 8K and 16K, realistic rows at 8K, and with the
        # exchanges kept out of the recompute
        *[Point(f"moe_30B-A3B_12L_{seq // 1024}k_ep4_{workload}_exact_tokens", MOE, 4, seq,
                cut + _ep(4) + TOKENS, workload=workload, estimate_s=80)
          for seq, workload in ((8192, "text"), (16384, "text"), (8192, "realistic"))],
        Point("moe_30B-A3B_12L_8k_ep4_text_exact_tokens_keep_exchanges", MOE, 4, 8192,
              cut + _ep(4) + TOKENS + KEEP_EXCHANGES,
              workload="text", estimate_s=80),
        # the token dispatch compiled (it compiles since b28e3b0)
        compiled(Point("moe_30B-A3B_12L_8k_ep4_text_exact_tokens", MOE, 4, 8192,
                       cut + _ep(4) + TOKENS, workload="text", estimate_s=80), 70),
        # the toy rows with the encoders replicated (no per-block FSDP collectives) and not
        # checkpointed: how much of the media path's fixed cost those take
        *[Point(f"moe_30B-A3B_12L_8k_ep4_{workload}_exact_encoders_replicated_no_ac", MOE, 4,
                8192, cut + _ep(4) + REPLICATED + NO_ENCODER_AC,
                workload=workload, estimate_s=80)
          for workload in ("toy", "realistic")],
        # each encoder block an FSDP unit (one gather per block and pass; the default is one
        # per encoder, parallelism.encoder_fsdp_unit), with and without encoder AC, and encoder
        # AC off alone (the toy rows with block units profile their last step, next to the
        # default toy point's profile above)
        *[Point(f"moe_30B-A3B_12L_8k_ep4_{workload}_exact_{tag}", MOE, 4, 8192,
                cut + _ep(4) + flags
                + (profile if (workload, tag) == ("toy", "encoder_unit_block") else ()),
                workload=workload, estimate_s=80)
          for workload in ("toy", "realistic")
          for tag, flags in (("encoder_unit_block", BLOCK_UNITS),
                             ("encoder_unit_block_no_ac", BLOCK_UNITS + NO_ENCODER_AC),
                             ("encoders_no_ac", NO_ENCODER_AC),
                             ("encoder_ac_op", OP_ENCODER_AC))],
        # EP x Ulysses x FSDP at long context: 16K positions per GPU at 32K (SP2) and 64K (SP4)
        *[Point(f"moe_30B-A3B_12L_{seq // 1024}k_sp{sp}_ep4_{workload}_exact", MOE, 4, seq,
                cut + _ep(4) + _sp(sp), workload=workload, steps=6, warmup=2, estimate_s=100)
          for seq, sp, workload in ((32768, 2, "text"), (32768, 2, "realistic"),
                                    (65536, 4, "text"))],
        point("8k_ep2_text_cap1.25", 8192, _ep(2) + best, "text"),
        point("8k_ep4_toy_cap1.25", 8192, _ep(4) + best, "toy"),
        # a log line every 10 steps (as moe_2gpu's *_log10 points): long text and toy rows
        # with the NCCL and the NVSHMEM exchange (with 4 ranks, each layer's host sync waits
        # for the slowest of four), and the toy rows with the encoders replicated
        *[Point(f"moe_30B-A3B_12L_8k_ep4_{workload}_exact_log10{suffix}", MOE, 4, 8192,
                cut + _ep(4) + LOG10 + flags, workload=workload, steps=30, warmup=10,
                estimate_s=90)
          for suffix, flags in (("", ()), ("_nvshmem", NVSHMEM))
          for workload in ("long_text", "toy")],
        Point("moe_30B-A3B_12L_8k_ep4_toy_exact_log10_encoders_replicated", MOE, 4, 8192,
              cut + _ep(4) + LOG10 + REPLICATED, workload="toy", steps=30, warmup=10,
              estimate_s=90),
        # the two toy-row gains of 2026-11-27 (ninth session) together: the NVSHMEM exchange
        # (0.86x of its long text against NCCL's 0.76x) and replicated encoders (0.83x)
        Point("moe_30B-A3B_12L_8k_ep4_toy_exact_log10_nvshmem_encoders_replicated", MOE, 4,
              8192, cut + _ep(4) + LOG10 + NVSHMEM + REPLICATED, workload="toy", steps=30,
              warmup=10, estimate_s=90),
        # compiled (the encoders' blocks too), NCCL exchange: the encoders' host time is the
        # toy rows' media cost with NCCL (0.10 s a step, against 0.03 s with NVSHMEM, whose
        # step has no per-layer host sync to expose it; tenth session)
        *[compiled(Point(f"moe_30B-A3B_12L_8k_ep4_{workload}_exact_log10", MOE, 4, 8192,
                         cut + _ep(4) + LOG10, workload=workload, steps=30, warmup=10,
                         estimate_s=90), 70)
          for workload in ("long_text", "toy")],
        # the full 48-layer model (4x H200 only: 31.8B parameters, 7.96B per GPU under EP4 and
        # FSDP, 118 GiB of fp32 parameters, gradients and AdamW states per GPU before
        # activations), text at 8K
        Point("moe_30B-A3B_48L_8k_ep4_text_exact", MOE, 4, 8192, FULL + _ep(4),
              workload="text", steps=6, warmup=2, estimate_s=180),
        # the part of the step that does not grow with tokens (0.12 s of 0.43 s at 8K, eleventh
        # session: the compute stream waiting on the exchanges, 12 host syncs a step; 8K peaks
        # at 38 of 80 GiB with full AC)
        *fixed_part_points(4),
        # ... without AC and compiled: the fewest launches and exchanges per step (no recompute,
        # fused blocks), so the least host time, which is what the 8K step's fixed part is (the
        # forward's GPU idles 109 of 239 ms behind the host, nineteenth session's profile)
        *[compiled(p, 70) for p in fixed_part_points(4) if p.name.endswith("_no_ac")],
    ]


def fixed_part_points(ep: int) -> list[Point]:
    """The MoE 12-layer cut on ``ep`` GPUs, EP over all of them, text at 8K and 16K: without
    activation checkpointing (no recompute: 4 exchanges per layer and step instead of 6) and
    with the NVSHMEM exchange (no host sync per layer), each next to the default points of its
    plan: what part of the step does not grow with tokens (issue 12); also both at once; and
    with no FSDP unit resharded after its forward (no all-gather in the backward); and with the
    group's tokens gathered (``expert_dispatch = "gather"``: no host read, fixed shapes), eager
    and compiled (each MoE layer one graph), compiled with the optimizer's update (``_opt``),
    with the experts' compute copies too (``_opt_cc``) and with the moments in bf16 too
    (``_opt_cc_m16``); and with the experts' weights and the moments in bf16, without copies
    (``_opt_w16_m16``)."""
    points = [Point(f"moe_30B-A3B_12L_{seq // 1024}k_ep{ep}_text_exact_{tag}", MOE, ep, seq,
                    _layers(12) + flags + _ep(ep), workload="text", estimate_s=80)
              for tag, flags in (("no_ac", NO_AC), ("nvshmem", FULL + NVSHMEM),
                                 ("no_ac_nvshmem", NO_AC + NVSHMEM),
                                 ("reshard_never", FULL + RESHARD_NEVER), ("gather", FULL + GATHER))
              for seq in (8192, 16384)]
    gather = [compiled(p, 70) for p in points if p.name.endswith("_gather")]
    # 27 timed steps, as moe_1gpu's: a fixed part from 7 steps moves by the rows' spread
    optimizer = [dataclasses.replace(with_compiled_optimizer(p), steps=30,
                                     estimate_s=p.estimate_s + 20) for p in gather]
    copies = [with_compute_copies(p) for p in optimizer]
    return (points + gather + optimizer + copies + [with_bf16_moments(p) for p in copies]
            + [with_bf16_moments(with_bf16_expert_weights(p)) for p in optimizer])


def moe_2gpu() -> list[Point]:
    """Qwen3-MoE#Omni at the 30B-A3B layer shape cut to 12 layers on 2 GPUs (issue 12's EP2
    figures): experts over both ranks (EP2: each expert on one rank, outside FSDP under full AC
    since 720d06a; the rest FSDP over both), full activation checkpointing, the exact
    dispatcher, 8K: packed text, text in documents as long as the media rows', toy and
    realistic rows; packed text at 16K (whether the step scales with tokens); then text and toy
    compiled; long text and toy with a log line every 10 steps, with the NCCL and the NVSHMEM
    expert exchange (``parallelism.expert_exchange``); last text and realistic rows
    at 32K with Ulysses SP2 on the same two ranks. About 65 GiB of sharded
    fp32 states and AdamW moments per GPU: H100s are tight (the 8K points peaked at 70-75 GiB
    on H200s)."""
    cut = _layers(12) + FULL + _ep(2)

    def point(seq: int, workload: str, layout: str = "ep2", extra: tuple[str, ...] = (),
              suffix: str = "", estimate_s: int = 90, **kw) -> Point:
        return Point(f"moe_30B-A3B_12L_{seq // 1024}k_{layout}_{workload}_exact{suffix}", MOE,
                     2, seq, cut + extra, workload=workload, estimate_s=estimate_s, **kw)

    eager = [point(8192, w) for w in ("text", "long_text", "toy", "realistic")]
    # a log line every 10 steps (as omni_2gpu's *_log10 points)
    log10 = [point(8192, w, extra=LOG10, suffix="_log10", steps=30, warmup=10)
             for w in ("long_text", "toy")]
    # the same with the NVSHMEM exchange (split sizes on the device: no host sync per layer)
    log10 += [point(8192, w, extra=LOG10 + NVSHMEM, suffix="_log10_nvshmem", steps=30,
                    warmup=10) for w in ("long_text", "toy")]
    # the toy rows with the encoders replicated (no FSDP collectives of their own)
    log10.append(point(8192, "toy", extra=LOG10 + REPLICATED, suffix="_log10_encoders_replicated",
                       steps=30, warmup=10))
    # EP2 x Ulysses SP2 x FSDP at 32K: 16K positions per GPU, as the 8K points' 8K
    long = [point(32768, w, layout="sp2_ep2", extra=_sp(2), steps=6, warmup=2, estimate_s=120)
            for w in ("text", "realistic")]
    # the step's part that does not grow with tokens, next to the 8K and 16K text points
    text16 = point(16384, "text", steps=8)
    # the 16K text point compiled too: the compiled gather points' fixed part needs a compiled
    # default pair beside it; and the realistic rows compiled with each dispatch (the gather
    # dispatch's 1.19x was measured on text only)
    realistic = [compiled(point(8192, "realistic", extra=extra, suffix=suffix), 70)
                 for extra, suffix in (((), ""), (GATHER, "_gather"))]
    # the realistic rows with every setting of the fixed-part points' last pair (the gather
    # dispatch compiled, the update compiled, the experts' weights and the moments in bf16)
    best = dataclasses.replace(
        with_bf16_moments(with_bf16_expert_weights(with_compiled_optimizer(realistic[1]))),
        steps=30, estimate_s=realistic[1].estimate_s + 30)
    return (eager + [text16] + [compiled(p, 70) for p in eager[::2]] + [compiled(text16, 70)]
            + realistic + log10 + long + fixed_part_points(2) + [best])


def moe_1gpu() -> list[Point]:
    """One EP4 rank's share of the MoE 12-layer cut on one GPU (flavor ``30B-A3B_ep4_rank``
    of scripts/omni_flavors.py: 32 experts, top 8, so the rank's expert weights and expert
    copies per token), packed text at 8K and 16K, full AC, eager and compiled: the part of
    the step that does not grow with tokens without any exchange, skew or FSDP collective
    (issue 12: the EP4 pair's is 0.079 s compiled, 22.9% of its 8K step); last the realistic
    media rows at 8K, compiled; then the compiled points with the optimizer's update compiled
    too, those with the experts reading the bf16 copies the optimizer keeps, and those with
    the moments in bf16 too (``_m16``); last the compiled-update points with the experts'
    weights and the moments in bf16 (``_opt_w16_m16``), without compute copies.

    Each point times 27 steps: the 16K steps move by +-10 ms from row to row, so a fixed part
    (2 x the 8K mean - the 16K mean) from 7 steps moved by 10 ms between calls; 20 more steps
    cost about 10 s a pair."""
    cut = _layers(12) + FULL + _ep(1) + OMNI_FLAVORS + ("--model.flavor", "30B-A3B_ep4_rank")
    points = [Point(f"moe_30B-A3B-ep4rank_12L_{seq // 1024}k_1gpu_text_exact", MOE, 1, seq, cut,
                    steps=30, workload="text", estimate_s=70) for seq in (8192, 16384)]
    realistic = Point("moe_30B-A3B-ep4rank_12L_8k_1gpu_realistic_exact", MOE, 1, 8192, cut,
                      steps=30, workload="realistic", estimate_s=80)
    media = [compiled(p, 60) for p in points] + [compiled(realistic, 70)]
    optimizer = [with_compiled_optimizer(p) for p in media]
    copies = [with_compute_copies(p) for p in optimizer]
    bf16_weights = [with_bf16_moments(with_bf16_expert_weights(p)) for p in optimizer]
    return (points + media + optimizer + copies + [with_bf16_moments(p) for p in copies]
            + bf16_weights)


def moe_dispatch(ngpu: int) -> list[Point]:
    """MoE dispatch (issue 12) at the 30B-A3B layer shape: the exact uneven all-to-all (a host
    sync per layer) against capacity-padded dispatch (static splits), eager and compiled; with
    EP also the capacity-padded exchange in 2 overlapped chunks. One GPU: 2 layers, local
    dispatch; two: 4 layers, EP2; four: the anchor's 12 layers, EP4."""
    layers, ep = {1: (2, _ep(1)), 2: (4, _ep(2)), 4: (12, _ep(4))}[ngpu]
    cut = _layers(layers) + FULL + ep
    variants = [("exact", ()), ("cap1.25", _cap(1.25))]
    if ngpu >= 2:  # the exchange in 2 chunks overlapped with the experts (needs EP)
        variants.append(("cap1.25_chunks2", _cap(1.25) + _chunks(2)))
        variants.append(("exact_tokens", TOKENS))  # each token once per rank
    if ngpu == 4:
        variants += [("cap1.0", _cap(1.0)), ("cap2.0", _cap(2.0))]
    points = []
    for tag, extra in variants:
        point = Point(f"moe_{layers}L_8k_{ngpu}gpu_{tag}", MOE, ngpu, 8192, cut + extra,
                      estimate_s=90)
        points.append(point)
        if tag in ("exact", "cap1.25", "cap1.25_chunks2"):
            points.append(compiled(point, 90))
    if ngpu == 4:
        points.append(compiled(Point("moe_12L_16k_4gpu_cap1.25", MOE, 4, 16384,
                                     cut + _cap(1.25), steps=8, estimate_s=90), 90))
    return points


def hetero(ngpu: int) -> list[Point]:
    """Encoder layouts (issue 13) on the full 8B, realistic rows: data parallel with encoders
    per rank (default) vs items balanced over all ranks; at 32K with Ulysses over all GPUs,
    encoders replicated on the SP ranks vs items split over them vs balanced."""
    dp, balance = SEL, BALANCE
    sp = ("--parallelism.ulysses_degree", str(ngpu))
    points = [
        Point(f"omni_8B_8k_dp{ngpu}_realistic", LLAMA8B, ngpu, 8192, dp, workload="realistic"),
        Point(f"omni_8B_8k_dp{ngpu}_realistic_balance", LLAMA8B, ngpu, 8192, dp + balance,
              workload="realistic"),
    ]
    for mode in ("replicate", "split", "balance"):
        layout = FULL + sp + ("--parallelism.encoder_sequence_parallel", mode)
        points.append(Point(f"omni_8B_32k_sp{ngpu}_realistic_{mode}", LLAMA8B, ngpu, 32768,
                            layout, steps=6, warmup=2, workload="realistic", estimate_s=120))
    if ngpu >= 3:
        # non-colocated: both encoders on rank 0, the LLM data parallel over the others (eager:
        # the trainer refuses compile with non-colocated encoders), in lock step or pipelined;
        # 2 micro-batches per LLM rank and step, so that the pipelined schedule has one to
        # overlap (the homogeneous point beside them likewise)
        accumulate = ("--training.global_batch_size", str(2 * (ngpu - 1)))
        points.append(Point(f"omni_8B_8k_dp{ngpu}_realistic_accum2", LLAMA8B, ngpu, 8192,
                            dp + ("--training.global_batch_size", str(2 * ngpu)),
                            workload="realistic", steps=8, estimate_s=100))
        for schedule in ("sync", "pipelined"):
            points.append(Point(f"omni_8B_8k_noncolocated_1+{ngpu - 1}_{schedule}", LLAMA8B,
                                ngpu, 8192, dp + accumulate +
                                ("--parallelism.encoder_schedule", schedule),
                                workload="realistic", encoder_ranks=1, steps=8,
                                estimate_s=100))
    return points + [compiled(p) for p in points[:2]]


def llama_8gpu() -> list[Point]:
    """The 8-GPU runs, for when nvidia-h200-x8 is lent."""
    points = [
        Point("stock_llama3_8B_8k_fsdp8", "8B", 8, 8192, SEL, steps=12, stock=True),
        Point("omni_8B_8k_sp1_realistic", LLAMA8B, 8, 8192, SEL, steps=8, warmup=2,
              workload="realistic"),
        Point("omni_8B_8k_sp1_toy", LLAMA8B, 8, 8192, SEL, steps=8, warmup=2),
    ]
    for s, sp in ((32768, 2), (65536, 4), (131072, 8), (196608, 8)):
        ac = SEL if s <= 32768 else FULL
        points.append(Point(f"omni_8B_{s // 1024}k_sp{sp}_realistic", LLAMA8B, 8, s, ac + _sp(sp),
                            steps=6, warmup=2, workload="realistic"))
    return points


def moe_8gpu() -> list[Point]:
    """The full Qwen3-MoE#Omni 30B-A3B on 8 GPUs."""
    def point(name: str, seq: int, layout: tuple[str, ...], workload: str = "realistic") -> Point:
        return Point(name, MOE, 8, seq, FULL + layout, steps=6, warmup=2, workload=workload)

    return [
        point("moe_30B-A3B_8k_ep8_realistic", 8192, _ep(8)),
        point("moe_30B-A3B_8k_ep8_toy", 8192, _ep(8), "toy"),
        *[point(f"moe_30B-A3B_{s // 1024}k_ep8_realistic", s, _ep(8))
          for s in (16384, 32768, 65536)],
        point("moe_30B-A3B_32k_ep4_sp2_realistic", 32768, _ep(4) + _sp(2)),
    ]


def smoke_cpu() -> list[Point]:
    """CPU check of the runner itself: tiny flavors, every kind of point."""
    dense = ("--image-every", "256", "--video-every", "512")  # media in short toy rows too
    return [
        Point("smoke_llama_sp2_toy", LLAMA_DEBUG, 2, 2048, _sp(2), steps=4, warmup=1,
              build_args=dense),
        Point("smoke_moe_ep2_toy", MOE_DEBUG, 2, 1024, _layers(1) + _ep(2), steps=4, warmup=1,
              build_args=dense),
        Point("smoke_moe_ep2_capacity", MOE_DEBUG, 2, 1024, _layers(1) + _ep(2) + _cap(1.25),
              steps=4, warmup=1, build_args=dense),
        Point("smoke_llama_text_only", LLAMA_DEBUG, 2, 1024, (), steps=4, warmup=1,
              workload="text"),
        Point("smoke_llama_realistic", LLAMA_DEBUG, 2, 1024, (), steps=4, warmup=1,
              workload="realistic"),
    ]


def build_plans(llm_layers: int = 16) -> dict[str, list[Point]]:
    """Every plan; ``llm_layers``: the LLM layers of the 1-GPU plan."""
    return {"omni_1gpu": omni_1gpu(llm_layers), "omni_2gpu": omni_2gpu(),
            "llama_4gpu": llama_4gpu(), "moe_2gpu": moe_2gpu(),
            "moe_1gpu": moe_1gpu(), "moe_4gpu": moe_4gpu(), "llama_8gpu": llama_8gpu(),
            "moe_8gpu": moe_8gpu(), "smoke_cpu": smoke_cpu(),
            "hetero_2gpu": hetero(2), "hetero_4gpu": hetero(4),
            **{f"moe_dispatch_{n}gpu": moe_dispatch(n) for n in (1, 2, 4)}}


PLANS = build_plans()

# ----------------------------------------------------------------- reading logs
STEP_LINE = re.compile(
    r"step:\s*(\d+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+).*?tflops:\s*([\d,.]+)"
    r".*?mfu:\s*([\d.]+)%"
)
TIMESTAMP = re.compile(r"(\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}[,.]\d{3})")
RECOMPILE = "Recompiling function"  # dynamo's line under TORCH_LOGS=recompiles
# the trainer's expert-load summary on MoE step lines
MOE_FIELD = re.compile(r"moe: max/mean ([\d.]+) \(layer \d+\) dropped [\d,]+ \(([\d.]+)%\)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# the omni trainer's seconds per step since its previous line (stock lines have none), and the
# graphs torch.compile has made so far, summed over the ranks (compiled runs)
STEP_SECONDS = re.compile(r"step time: ([\d.]+)s")
#: torchrun's prefix on a rank's output lines (``--local-ranks-filter``/``LOG_RANK``)
RANK_PREFIX = re.compile(r"\[rank(\d+)\]:")
GRAPHS = re.compile(r"compiled graphs: (\d+)")
#: the omni trainer's peak active memory, after the peak reserved (stock lines have none)
ACTIVE = re.compile(r"active:\s*([\d.]+)GiB")


def _seconds(stamp: str) -> float:
    """A log timestamp (``2026-11-22 18:07:05,202``) in seconds."""
    return datetime.strptime(stamp.replace("T", " ").replace(",", "."),
                             "%Y-%m-%d %H:%M:%S.%f").timestamp()


def parse_steps(log: str) -> list[dict]:
    """The per-step metrics of a TorchTitan (stock or omni) log; ``time`` (s) when the line
    carries a timestamp, ``step_s`` when it says its step time and ``graphs`` when it says
    how many graphs the ranks compiled (omni lines). Where several ranks log (``LOG_RANK=0,1``:
    torchrun's ``[rankN]:`` prefixes), the lowest rank's lines alone: each rank's tokens/s and
    FLOPs are its own batch's."""
    lines = ANSI.sub("", log).splitlines()
    ranks = {int(r[1]) for line in lines
             if STEP_LINE.search(line) and (r := RANK_PREFIX.match(line))}
    first = f"[rank{min(ranks)}]:" if len(ranks) > 1 else None
    out = []
    for line in lines:
        m = STEP_LINE.search(line)
        if m and (first is None or line.startswith(first)):
            step = {"step": int(m[1]), "mem_gib": float(m[2]), "tps": float(m[3].replace(",", "")),
                    "tflops": float(m[4].replace(",", "")), "mfu": float(m[5])}
            stamp = TIMESTAMP.search(line)
            if stamp:
                step["time"] = _seconds(stamp[1])
            seconds = STEP_SECONDS.search(line)
            if seconds:
                step["step_s"] = float(seconds[1])
            graphs = GRAPHS.search(line)
            if graphs:
                step["graphs"] = int(graphs[1])
            active = ACTIVE.search(line)
            if active:
                step["mem_active_gib"] = float(active[1])
            moe = MOE_FIELD.search(line)
            if moe:
                step.update(max_over_mean=float(moe[1]), dropped_pct=float(moe[2]))
            out.append(step)
    return out


def count_recompiles(log: str) -> int:
    """torch.compile recompilations logged (rank 0's, under ``TORCH_LOGS=recompiles``)."""
    return sum(RECOMPILE in line for line in log.splitlines())


def _flag_value(args: tuple[str, ...], flag: str, default: int) -> int:
    """The last value given to ``flag`` in ``args`` (``--flag value`` or ``--flag=value``)."""
    value = default
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = int(args[i + 1])
        elif arg.startswith(flag + "="):
            value = int(arg.split("=", 1)[1])
    return value


def profiled_steps(args: tuple[str, ...], last_step: int) -> set[int]:
    """The steps a run with ``args`` slows by profiling: TorchTitan's profiler schedule
    (``profile_freq`` steps a cycle, the last ``profiler_warmup`` + ``profiler_active`` of
    them recorded) and the step after each recorded one (it writes the trace). Empty without
    ``--profiling.enable_profiling``."""
    if "--profiling.enable_profiling" not in args:
        return set()
    freq = _flag_value(args, "--profiling.profile_freq", 10)
    recorded = (_flag_value(args, "--profiling.profiler_warmup", 3)
                + _flag_value(args, "--profiling.profiler_active", 1))
    slowed = {s for s in range(1, last_step + 1) if (s - 1) % freq >= freq - recorded}
    return slowed | {s + 1 for s in range(1, last_step) if s % freq == 0}


def step_time(steps: list[dict], warmup: int, skip: set[int] = frozenset()) -> float | None:
    """Median seconds per step after ``warmup``, leaving out the steps of ``skip``: the lines'
    own step times where every line has one (the omni trainer's, on the GPU's clock: it logs a
    step's line at the end of the next one, so the lines' timestamps are not its step's end);
    else the gaps between consecutive step lines (with a line every ``log_freq`` steps, a gap
    is divided by the steps it spans; gaps spanning a step of ``skip`` are left out)."""
    if steps and all("step_s" in s for s in steps):
        own = [s["step_s"] for s in steps if s["step"] > warmup and s["step"] not in skip]
        return statistics.median(own) if own else None
    times = sorted((s["step"], s["time"]) for s in steps if "time" in s)
    gaps = [(t1 - t0) / (k1 - k0) for (k0, t0), (k1, t1) in zip(times, times[1:])
            if k0 >= warmup and not skip.intersection(range(k0 + 1, k1 + 1))]
    return statistics.median(gaps) if gaps else None


def titan_flops_per_token(point: Point) -> float:
    """TorchTitan's per-token training FLOPs of the point's LLM at its sequence length."""
    import torch

    import torchtitan_omni.models  # noqa: F401  (registers the specs)
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_omni.config.manager import parse_job_config

    if point.stock:
        import importlib

        importlib.import_module(FLAVORS_MODULE)  # the cut flavors, as the stock run imports them
        spec = get_train_spec("llama3")
        args = spec.model_args[point.config]
    else:
        # the config is validated against the point's world size (the caller's is restored)
        with mock.patch.dict(os.environ, {"WORLD_SIZE": str(point.ngpu)}):
            cfg = parse_job_config(["--job.config_file", point.config_file(), *point.args,
                                    *point.compile_args(), "--training.seq_len",
                                    str(point.seq_len)])
        spec = get_train_spec(cfg.model.name)
        # a copy: the registered flavor stays as registered for the next point
        args = copy.deepcopy(spec.model_args[cfg.model.flavor])
        args.update_from_config(cfg)  # applies omni.llm_layers
    with torch.device("meta"):
        model = spec.model_cls(args)
    _, flops = args.get_nparams_and_flops(model, point.seq_len)
    return float(flops)


def _identity(point: Point) -> dict:
    """What a row says about its point (the ratios pair rows by these)."""
    return {"name": point.name, "config": point.config, "ngpu": point.ngpu,
            "seq_len": point.seq_len, "stock": point.stock, "workload": point.workload,
            "compile": point.compile}


def summarize(point: Point, steps: list[dict], wall_s: float, rc, log: str = "") -> dict:
    """A point's row: medians over the steps after warm-up that profiling did not slow
    (:func:`profiled_steps`; all steps after warm-up where it slowed every one), peak memory
    over all."""
    row = {**_identity(point), "rc": rc, "wall_s": round(wall_s), "command": point.shell(),
           "steps_logged": len(steps),
           "recompiles": count_recompiles(log) if point.compile else None}
    timed = [s for s in steps if s["step"] > point.warmup]
    if not timed:
        return row
    profiled = profiled_steps(point.args, max(s["step"] for s in steps))
    unprofiled = [s for s in timed if s["step"] not in profiled]
    if unprofiled:
        if len(unprofiled) < len(timed):
            row["profiled_steps_left_out"] = len(timed) - len(unprofiled)
        timed = unprofiled
    else:
        profiled = set()
    share = point.gpu_share()
    tps = share * statistics.median(s["tps"] for s in timed)
    # how much single steps differ: a ratio smaller than this spread says little
    tps_range = (share * min(s["tps"] for s in timed), share * max(s["tps"] for s in timed))
    mfu = share * statistics.median(s["mfu"] for s in timed)
    tflops = share * statistics.median(s["tflops"] for s in timed)
    row.update(tps=tps, tps_range=tps_range, mfu=mfu, mem_gib=max(s["mem_gib"] for s in steps),
               step_s=step_time(steps, point.warmup, profiled))
    if all("mem_active_gib" in s for s in steps):
        row["mem_active_gib"] = max(s["mem_active_gib"] for s in steps)
    if all("step_s" in s for s in timed):
        # the mean, for the fixed part (fixed_parts): the 8K and 16K points run the same rows,
        # and a median of a few steps moves with which rows it lands on
        row["step_mean_s"] = statistics.fmean(s["step_s"] for s in timed)
        row["steps_timed"] = len(timed)
        if len(timed) > 1:  # how far the mean may be off: the fixed part's standard error
            row["step_sd_s"] = statistics.stdev(s["step_s"] for s in timed)
    # timed steps in which some rank compiled a graph (the line's count grew): such a step
    # waits for the compile on every rank
    counts = {s["step"]: s["graphs"] for s in steps if "graphs" in s}
    if counts:
        row["compile_steps_timed"] = sum(
            1 for s in timed if s["step"] - 1 in counts and s["step"] in counts
            and counts[s["step"]] > counts[s["step"] - 1])
    if all("dropped_pct" in s for s in timed):
        row.update(max_over_mean=statistics.median(s["max_over_mean"] for s in timed),
                   dropped_pct=statistics.median(s["dropped_pct"] for s in timed))
    if mfu > 0 and tflops > 0:
        peak = tflops * 1e12 / (mfu / 100)
        row["mfu_titan"] = 100 * tps * titan_flops_per_token(point) / peak
    return row


def variant(row: dict) -> str:
    """A row's name with its workload taken out: rows of one variant differ only in data
    (``omni_8B_8k_toy_log10`` and ``omni_8B_8k_long_text_log10`` are ``omni_8B_8k_{}_log10``)."""
    return row["name"].replace(f"_{row.get('workload')}", "_{}", 1)


def uses_float8(row: dict) -> bool:
    """Whether a row's command trains with float8 linears (:data:`FLOAT8`)."""
    return " ".join(FLOAT8[:2]) in row.get("command", "")


def add_ratios(rows: list[dict]) -> None:
    """Each measured row's tokens/s over the stock row of the same GPUs, sequence length,
    compile setting and linears' precision (bf16 or float8; ``vs_stock``), and over the omni
    text-only and long-text rows of the same model too (``vs_text``, ``vs_long_text``), when
    those were measured. Where several rows qualify, the one of the same variant (the same
    trainer flags, ``variant``) is the reference, else the plainest (the shortest name): a flag
    never borrows another flag's baseline."""
    def key(r, model: bool):
        return (r["ngpu"], r["seq_len"], r.get("compile", False), uses_float8(r),
                r.get("config") if model else None)

    def candidates(stock: bool, workload: str | None) -> dict:
        found: dict = defaultdict(list)
        for r in rows:
            if "tps" in r and bool(r.get("stock")) == stock and (
                    workload is None or r.get("workload") == workload):
                found[key(r, not stock)].append(r)
        return found

    refs = (("vs_stock", candidates(True, None), False),
            ("vs_text", candidates(False, "text"), True),
            ("vs_long_text", candidates(False, "long_text"), True))
    for r in rows:
        if "tps" not in r:
            continue
        for name, found, model in refs:
            pool = found.get(key(r, model))
            if not pool:
                continue
            same = [c for c in pool if variant(c) == variant(r)]
            ref = same[0] if same else min(pool, key=lambda c: len(c["name"]))
            r[name] = r["tps"] / ref["tps"]


# ----------------------------------------------------------------- datasets
def _built(point: Point) -> bool:
    """Whether the point's dataset is there, built with the arguments it would be now."""
    path = os.path.join(REPO, point.dataset(), "manifest.json")
    try:
        with open(path) as f:
            m = json.load(f)
    except (OSError, ValueError):
        return False
    return m.get("arguments") == point.build_command()[2:]  # built by this very command


def _ensure_stock_text() -> None:
    """The bundled text as one file, the stock runs' (and the text-only points') dataset."""
    subprocess.run([sys.executable, "-c", "from torchtitan_omni.data.default_dataset import "
                    "ensure_default_dataset as e; e(tokenizer_dir='assets/tokenizer')"],
                   cwd=REPO, check=True)
    os.makedirs(os.path.join(REPO, STOCK_TEXT), exist_ok=True)
    with open(os.path.join(REPO, "data/omni_default/train-text.jsonl")) as f, \
            open(os.path.join(REPO, STOCK_TEXT, "train.jsonl"), "w") as g:
        g.write(f.read())


def prepare_data(points: list[Point]) -> tuple[list[str], float]:
    """Build the datasets the points need and are missing (the bundled dataset and text
    first, realistic ones before toy ones: the first makes the shared media cache); returns
    the datasets built and the seconds it took."""
    start = time.monotonic()
    builds = {}
    for p in sorted(points, key=lambda p: WORKLOADS.index(p.workload)):
        if p.workload != "text" and not _built(p):
            builds.setdefault(p.dataset(), p.build_command())
    if any(p.workload == "text" for p in points):
        _ensure_stock_text()
    # one at a time: each build already uses every core for media, and later builds reuse
    # the media and processing results the first one cached
    for cmd in builds.values():
        if subprocess.run(cmd, cwd=REPO).returncode:
            raise SystemExit(f"building a dataset failed: {shlex.join(cmd)}")
    for p in points:
        share = media_share(p) if p.workload == "long_text" else 0.0
        if share != 0.0:
            raise SystemExit(f"{p.dataset()}: the long-text rows hold media (share {share}): "
                             "they would not be the text baseline")
    return list(builds), time.monotonic() - start


def media_share(point: Point) -> float | None:
    """The media share of the point's dataset (its builder's manifest)."""
    if point.workload == "text":
        return 0.0
    try:
        with open(os.path.join(REPO, point.dataset(), "manifest.json")) as f:
            return json.load(f).get("media_share")
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------- the table
def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _data_cell(row: dict) -> str:
    """``realistic (50%)``: the workload and its media share (two digits under 1%)."""
    share, workload = row.get("media_share"), row.get("workload", "-")
    if share is None or workload in ("text", "long_text"):
        return workload.replace("_", " ")
    return f"{workload} ({100 * share:{'.2g' if share < 0.01 else '.0f'}}%)"


def fixed_parts(rows: list[dict]) -> list[dict]:
    """What of a step does not grow with tokens (issue 12): for each row with a twin at twice
    its sequence length (the same name with ``_8k`` for ``_16k``, say), ``2 x short - long``
    from their mean step times (``step_mean_s``), in seconds and as a share of the short
    step, with the timed steps of each and the fixed part's standard error from the steps'
    spread (None where a point timed one step)."""
    by_name = {r["name"]: r for r in rows if r.get("step_mean_s")}
    pairs = []
    for short in by_name.values():
        k = short["seq_len"] // 1024
        long = by_name.get(short["name"].replace(f"_{k}k", f"_{2 * k}k", 1))
        if long is None or long is short or long["seq_len"] != 2 * short["seq_len"]:
            continue
        fixed = 2 * short["step_mean_s"] - long["step_mean_s"]
        stderr = None
        if "step_sd_s" in short and "step_sd_s" in long:
            stderr = math.sqrt(4 * short["step_sd_s"] ** 2 / short["steps_timed"]
                               + long["step_sd_s"] ** 2 / long["steps_timed"])
        pairs.append({"short": short["name"], "long": long["name"],
                      "short_s": short["step_mean_s"], "long_s": long["step_mean_s"],
                      "fixed_s": fixed, "share": fixed / short["step_mean_s"],
                      "steps": (short.get("steps_timed"), long.get("steps_timed")),
                      "stderr_s": stderr})
    return pairs


def table(rows: list[dict], device: str, data_note: str = "") -> str:
    """The markdown table of a run, then each point's command."""
    lines = [
        f"Device: {device}. tokens/s/GPU (every real LLM position, media included), MFU and "
        "step time: medians over the steps after warm-up, leaving out those profiling "
        "slows (the profiler's recorded steps and each trace's export) "
        "(steps' range: their slowest and "
        "fastest step's tokens/s/GPU); vs stock / vs text-only / vs long text: tokens/s "
        "over the stock, omni text-only (packed short documents) and omni long-text (one "
        "document per row, as the media rows) points of the same GPUs, seq, compile "
        "setting and linears' precision (bf16 or float8); "
        "memory: peak reserved (peak active, what tensors held, where the omni trainer logs "
        "it); recompiles: rank 0's under TORCH_LOGS=recompiles.",
        *([data_note] if data_note else []),
        "",
        "| point | GPUs | seq | data (media share) | compile | tokens/s/GPU | steps' range "
        "| vs stock "
        "| vs text-only | vs long text | MFU (model FLOPs) | MFU (TorchTitan formula) | step (s) "
        "| peak mem (GiB) | recompiles | status |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
        "| --- | --- |",
    ]
    for r in rows:
        status = r.get("status") or ("ok" if r.get("rc") == 0 else f"exit {r.get('rc')}")
        recompiles = "-" if r.get("recompiles") is None else str(r["recompiles"])
        active = (f" ({r['mem_active_gib']:.1f} active)" if r.get("mem_active_gib") is not None
                  else "")
        spread = ("-" if r.get("tps_range") is None
                  else f"{r['tps_range'][0]:,.0f}-{r['tps_range'][1]:,.0f}")
        lines.append(
            f"| {r['name']} | {r['ngpu']} | {r['seq_len'] // 1024}K | {_data_cell(r)} | "
            f"{'yes' if r.get('compile') else 'no'} | {_fmt(r.get('tps'), ',.0f')} | {spread} | "
            f"{_fmt(r.get('vs_stock'), '.2f', 'x')} | {_fmt(r.get('vs_text'), '.2f', 'x')} | "
            f"{_fmt(r.get('vs_long_text'), '.2f', 'x')} | "
            f"{_fmt(r.get('mfu'), '.1f', '%')} | {_fmt(r.get('mfu_titan'), '.1f', '%')} | "
            f"{_fmt(r.get('step_s'), '.2f')} | {_fmt(r.get('mem_gib'), '.1f')}{active} | "
            f"{recompiles} | "
            f"{status} |")
    moe = [r for r in rows if "dropped_pct" in r]
    if moe:
        lines += ["", "| point | MoE worst layer max/mean tokens per expert | copies dropped |",
                  "| --- | --- | --- |"]
        lines += [f"| {r['name']} | {r['max_over_mean']:.2f} | {r['dropped_pct']:.2f}% |"
                  for r in moe]
    pairs = fixed_parts(rows)
    if pairs:
        lines += ["", "| short point | long point | mean step, short (ms) | mean step, long (ms) "
                  "| fixed part: 2 x short - long (ms) | of the short step | timed steps "
                  "(short, long) | standard error (ms) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {p['short']} | {p['long']} | {1000 * p['short_s']:.1f} | "
                  f"{1000 * p['long_s']:.1f} | {1000 * p['fixed_s']:.1f} | "
                  f"{100 * p['share']:.1f}% | {p['steps'][0]}, {p['steps'][1]} | "
                  + ("-" if p["stderr_s"] is None else f"{1000 * p['stderr_s']:.1f}") + " |"
                  for p in pairs]
    lines += ["", "Commands:", ""]
    lines += [f"- `{r['name']}`: `{r['command']}`" for r in rows]
    return "\n".join(lines) + "\n"


def launch_queues(environ: dict | None = None) -> str:
    """The CUDA driver's launch-queue setting each kind of point runs with: omni points get
    ``run_train.sh``'s default (4x) unless the caller set one, stock points (plain ``torchrun``)
    the caller's or the driver's."""
    value = (os.environ if environ is None else environ).get("CUDA_SCALE_LAUNCH_QUEUES")
    if value:  # run_train.sh, like this, takes an empty value for unset
        return f"CUDA_SCALE_LAUNCH_QUEUES={value} for every point"
    return ("CUDA_SCALE_LAUNCH_QUEUES=4x for omni points (run_train.sh), the driver's default "
            "for stock points")


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return (f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}, "
                f"torch {torch.__version__}, {launch_queues()}")
    return f"CPU (gloo), torch {torch.__version__}"


# ----------------------------------------------------------------- running
def run_point(point: Point, timeout: float | None) -> tuple[str, object]:
    """Run one point; returns (log, exit code or "timeout")."""
    # own process group: a point past the deadline is stopped with torchrun's workers
    proc = subprocess.Popen(point.command(), cwd=REPO, env={**os.environ, **point.environment()},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        return proc.communicate(timeout=timeout)[0], proc.returncode
    except subprocess.TimeoutExpired:
        # SIGTERM first: torchrun then stops its workers (they run in sessions of their own)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            log = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log = proc.communicate()[0]
        return log, "timeout"


def select(points: list[Point], only: str, no_compile: bool, compile_only: bool) -> list[Point]:
    """The points to run: by name (``only``, comma-separated) and compile setting."""
    names = set(filter(None, only.split(",")))
    unknown = names - {p.name for p in points}
    if unknown:
        raise SystemExit(f"bench_scaling: no point {', '.join(sorted(unknown))} in this plan")
    return [p for p in points if (not names or p.name in names)
            and not (no_compile and p.compile) and not (compile_only and not p.compile)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plan", choices=sorted(PLANS), required=True)
    p.add_argument("--only", default="", help="comma-separated point names (default: all)")
    p.add_argument("--out", required=True, help="markdown table (a .json file goes beside it)")
    p.add_argument("--logs", default="", help="folder for each point's full log")
    p.add_argument("--deadline", type=float, default=0,
                   help="seconds; skip points that would not fit")
    p.add_argument("--extra", default="", help="arguments appended to every point (e.g. profiling)")
    p.add_argument("--no-compile", action="store_true", help="drop the torch.compile points")
    p.add_argument("--compile-only", action="store_true", help="only the torch.compile points")
    p.add_argument("--llm-layers", type=int, default=16, choices=LAYER_CUTS,
                   help="LLM layers of the omni_1gpu plan (16 needs an H200's 141 GB)")
    args = p.parse_args(argv)
    if args.no_compile and args.compile_only:
        p.error("--no-compile and --compile-only exclude each other")

    start = time.monotonic()
    points = select(build_plans(args.llm_layers)[args.plan], args.only, args.no_compile,
                    args.compile_only)
    if args.extra:
        extra = tuple(shlex.split(args.extra))
        points = [dataclasses.replace(pt, args=pt.args + extra) for pt in points]
    built, data_s = prepare_data(points)
    data_note = (f"Datasets built before the points in {data_s:.0f} s: {', '.join(built)}."
                 if built else "Datasets: all present.")
    print(data_note, flush=True)
    rows = []
    for point in points:
        left = args.deadline - (time.monotonic() - start) if args.deadline else None
        if left is not None and left < point.estimate_s:
            rows.append({**_identity(point), "command": point.shell(),
                         "status": "not run (deadline)"})
            continue
        t0 = time.monotonic()
        log, rc = run_point(point, left)
        if args.logs:
            os.makedirs(args.logs, exist_ok=True)
            with open(os.path.join(args.logs, f"{point.name}.log"), "w") as f:
                f.write(log)
        row = summarize(point, parse_steps(log), time.monotonic() - t0, rc, log)
        if rc != 0:
            oom = "out of memory" in log.lower() or "OutOfMemoryError" in log
            row["status"] = "OOM" if oom else (rc if rc == "timeout" else f"exit {rc}")
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
    for point, row in zip(points, rows):
        row["media_share"] = media_share(point)
    add_ratios(rows)

    text = table(rows, device_name(), data_note)
    with open(args.out, "w") as f:
        f.write(text)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
