"""The benchmark scripts' own logic: reading training logs and profiler traces, the plans,
their ratios and the stock TorchTitan flavors they use."""

import dataclasses
import importlib
import json
import os
import shlex
import subprocess
import sys
import tomllib

import pytest
import torch

from tests.harness import REPO, load_script as _script, metrics_processor


OMNI_LINE = (
    "[rank0]:[titan] 2026-11-22 18:07:05,202 - root - INFO - \x1b[31mstep: 11  \x1b[32mloss:  "
    "7.39948 (text: 7.39948  gen_image: 0.00000)  \x1b[38;2;180;60;0mgrad_norm:  4.2762  "
    "\x1b[38;2;54;234;195mmemory: 74.12GiB(53.01%)  \x1b[34mtps: 4,424  \x1b[36mtflops: 226.62  "
    "\x1b[35mmfu: 22.91%\x1b[39m"
)
STOCK_LINE = (
    "[rank0]:[titan] 2026-11-22 18:06:10,000 - root - INFO - step: 12  loss:  7.21135  "
    "grad_norm: 16.0736  memory: 63.74GiB(45.59%)  tps: 8,507  tflops: 492.69  mfu: 49.82%"
)



def _refuses_without_a_gpu(script: str) -> None:
    """``scripts/<script>.py`` run without ``--smoke`` on a machine with no GPU exits 1 with
    its one-line reason."""
    run = subprocess.run([sys.executable, f"scripts/{script}.py"], cwd=REPO,
                         capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 1
    assert run.stderr.strip().endswith("needs a CUDA GPU (use --smoke for a CPU check)")

def test_step_lines_of_omni_and_stock_logs():
    bench = _script("bench_scaling")
    steps = bench.parse_steps("\n".join(["noise", OMNI_LINE, STOCK_LINE]))
    assert steps[1]["time"] - steps[0]["time"] == pytest.approx(-55.202)  # from the timestamps
    assert [{k: v for k, v in s.items() if k != "time"} for s in steps] == [
        {"step": 11, "mem_gib": 74.12, "tps": 4424.0, "tflops": 226.62, "mfu": 22.91},
        {"step": 12, "mem_gib": 63.74, "tps": 8507.0, "tflops": 492.69, "mfu": 49.82},
    ]
    point = bench.Point("p", "8B", 4, 8192, stock=True, warmup=11)
    row = bench.summarize(point, steps[:1] + steps[1:], 10.0, 0)
    assert row["tps"] == 8507.0 and row["mem_gib"] == 74.12  # median after warm-up, peak overall
    warm_up = dict(steps[0], step=10, tps=100.0)  # a warm-up step: outside the range
    row = bench.summarize(dataclasses.replace(point, warmup=10), [warm_up, *steps], 10.0, 0)
    assert row["tps_range"] == (4424.0, 8507.0)  # the slowest and fastest step after warm-up
    assert "| 6,466 | 4,424-8,507 |" in bench.table([row], "test")
    assert "-m torchtitan.train" in row["command"] and "--training.seq_len 8192" in row["command"]


def test_peak_active_memory_read_where_the_omni_trainer_logs_it():
    """The omni trainer logs the peak active memory after the peak reserved: the row and the
    table carry both (the reserved peak alone cannot tell a larger working set from the
    caching allocator's slack); a log without it (stock, older lines) gives none."""
    bench = _script("bench_scaling")
    line = OMNI_LINE.replace("GiB(53.01%)  ", "GiB(53.01%) active: 70.50GiB  ")
    steps = bench.parse_steps("\n".join([line, line.replace("step: 11", "step: 12")
                                         .replace("active: 70.50", "active: 71.25")]))
    assert [s["mem_active_gib"] for s in steps] == [70.50, 71.25]
    assert steps[0]["mem_gib"] == 74.12 and steps[0]["tps"] == 4424.0
    point = bench.Point("p", "8B", 4, 8192, stock=True, warmup=10)
    row = bench.summarize(point, steps, 10.0, 0)
    assert row["mem_active_gib"] == 71.25
    assert "| 74.1 (71.2 active) |" in bench.table([row], "test")
    row = bench.summarize(point, bench.parse_steps(OMNI_LINE), 10.0, 0)
    assert "mem_active_gib" not in row and "| 74.1 |" in bench.table([row], "test")


def test_step_lines_of_several_ranks_are_the_lowest_ranks():
    """With ``LOG_RANK=0,1`` both ranks print their lines (each rank's tokens/s is its own
    batch's): the table reads rank 0's alone, whichever order they come in."""
    bench = _script("bench_scaling")
    rank1 = OMNI_LINE.replace("[rank0]:", "[rank1]:").replace("tps: 4,424", "tps: 9,999")
    steps = bench.parse_steps("\n".join([rank1, OMNI_LINE, rank1.replace("step: 11", "step: 12"),
                                         OMNI_LINE.replace("step: 11", "step: 12")]))
    assert [(s["step"], s["tps"]) for s in steps] == [(11, 4424.0), (12, 4424.0)]
    # rank 1 alone (LOG_RANK=1): its lines are the log's
    assert [s["tps"] for s in bench.parse_steps(rank1)] == [9999.0]


def test_step_time_reads_the_omni_lines_own_step_times(caplog):
    """The omni trainer logs a step's line at the end of the next step, so its timestamps
    alternate with the host's lead; the bench takes the step time each line states (here
    steady 1.0 s steps under timestamps 0.6 and 1.4 s apart), and reads it from a line the
    trainer's metrics processor really printed. Stock lines have none: their gaps count."""
    bench = _script("bench_scaling")
    stamps = ["10:00:00,000", "10:00:30,000", "10:00:30,600", "10:00:32,000", "10:00:32,600"]
    lines = [_omni_line(i + 1, t, 8000) + "  step time: 1.000s" for i, t in enumerate(stamps)]
    steps = bench.parse_steps("\n".join(lines))
    assert [s["step_s"] for s in steps] == [1.0] * 5
    assert bench.step_time(steps, warmup=2) == 1.0
    assert bench.step_time(steps, warmup=2, skip={3, 4, 5}) is None
    gaps = [{k: v for k, v in s.items() if k != "step_s"} for s in steps]
    assert bench.step_time(gaps, warmup=2) == pytest.approx(0.6)  # 0.6, 1.4, 0.6: the median

    metrics = metrics_processor("--metrics.log_freq", "4")
    window = metrics.close_window()
    window.start, window.end = 100.0, 106.0  # a first line, after steps 1-3 of a job
    window.ntokens, window.flops, window.steps = 3000, 6e12, 3
    with caplog.at_level("INFO"):
        metrics.log_losses(3, 2.0, 2.0, {"text": 2.0}, 1.0, window=window)
    (logged,) = bench.parse_steps("\n".join(r.getMessage() for r in caplog.records))
    assert logged["step"] == 3 and logged["step_s"] == 2.0 and logged["tps"] == 500.0


def test_timed_steps_in_which_some_rank_compiled_are_counted():
    """A compiled run's lines give the graphs the ranks have compiled, summed; a timed step
    whose line's count grew waited for a compile (step 4 here; step 2's growth is warm-up)."""
    bench = _script("bench_scaling")
    lines = [_omni_line(k, f"10:00:0{k},000", 8000) + f"  step time: 1.000s  compiled graphs: {g}"
             for k, g in ((1, 5), (2, 6), (3, 6), (4, 7), (5, 7))]
    steps = bench.parse_steps("\n".join(lines))
    assert [s["graphs"] for s in steps] == [5, 6, 6, 7, 7]
    for s in steps:
        s["mfu"] = s["tflops"] = 0.0  # no FLOP count needed here
    row = bench.summarize(bench.Point("p", "x.toml", 2, 8192, warmup=2), steps, 1.0, 0)
    assert row["compile_steps_timed"] == 1 and row["step_s"] == 1.0


def test_fixed_part_of_a_point_and_its_twice_as_long_twin():
    """Each row gets the mean of its timed steps' own times (warm-up and profiled steps left
    out); a row with a twin at twice its sequence length (``_8k`` -> ``_16k`` in the name) gets
    the step's fixed part, ``2 x short - long``, in the table; rows without one get none."""
    bench = _script("bench_scaling")

    def row(name: str, seq: int, seconds: list[float], args=()) -> dict:
        lines = [_omni_line(k, f"10:00:{k:02d},000", 8000) + f"  step time: {t:.3f}s"
                 for k, t in enumerate(seconds, start=1)]
        steps = bench.parse_steps("\n".join(lines))
        for s in steps:
            s["mfu"] = s["tflops"] = 0.0  # no FLOP count needed here
        return bench.summarize(bench.Point(name, "x.toml", 1, seq, args, steps=len(seconds),
                                           warmup=2), steps, 1.0, 0)

    profile = ("--profiling.enable_profiling", "--profiling.profile_freq", "8")
    # step 1-2 warm-up; under the profiler steps 5-9 are slowed and left out
    short = row("moe_12L_8k_text", 8192, [9.0, 5.0, 0.16, 0.17, 3.0, 3.0, 3.0, 3.0, 3.0, 0.21],
                profile)
    assert abs(short["step_mean_s"] - 0.18) < 1e-9  # the mean, not the median
    long = row("moe_12L_16k_text", 16384, [9.0, 5.0, 0.30, 0.31, 0.32])
    other = row("moe_12L_8k_text_compile", 8192, [9.0, 5.0, 0.2, 0.2])
    (pair,) = bench.fixed_parts([short, long, other])
    assert pair["short"] == "moe_12L_8k_text" and pair["long"] == "moe_12L_16k_text"
    assert abs(pair["fixed_s"] - 0.05) < 1e-9 and abs(pair["share"] - 0.05 / 0.18) < 1e-9
    # timed steps 3, 4, 10 (variance 7e-4) and 3-5 (1e-4): sqrt(4 x 7e-4 / 3 + 1e-4 / 3)
    assert pair["steps"] == (3, 3) and abs(pair["stderr_s"] - (29e-4 / 3) ** 0.5) < 1e-9
    text = bench.table([short, long, other], "test")
    assert ("| moe_12L_8k_text | moe_12L_16k_text | 180.0 | 310.0 | 50.0 | 27.8% | 3, 3 | "
            "31.1 |") in text
    # a point timed one step has no spread: no standard error
    one = row("moe_12L_16k_text", 16384, [9.0, 5.0, 0.30])
    (single,) = bench.fixed_parts([short, one])
    assert single["stderr_s"] is None and single["steps"] == (3, 1)
    assert "| 3, 1 | - |" in bench.table([short, one], "test")
    assert "fixed part" not in bench.table([other], "test")


def test_steps_slowed_by_profiling_are_left_out_of_the_medians():
    """TorchTitan's profiler records the last 4 steps of each ``profile_freq`` cycle (3 warm-up,
    1 active) and exports the trace in the step after: those steps are slower and leave the
    medians; without profiling every step after warm-up counts."""
    bench = _script("bench_scaling")
    profile = ("--profiling.enable_profiling", "--profiling.profile_freq", "10")
    assert bench.profiled_steps(profile, 12) == {7, 8, 9, 10, 11}
    assert bench.profiled_steps(profile + ("--profiling.profiler_warmup=1",), 10) == {9, 10}
    assert bench.profiled_steps((), 12) == set()
    # steps 1-6 at 20,000 tokens/s (5 s apart), 7-10 at 10,000 (10 s apart) under the profiler
    steps = [{"step": k, "time": 5.0 * min(k, 6) + 10.0 * max(0, k - 6), "mem_gib": 1.0,
              "tps": 20000.0 if k <= 6 else 10000.0, "tflops": 0.0, "mfu": 0.0}
             for k in range(1, 11)]
    point = bench.Point("p", "x.toml", 1, 8192, profile, steps=10, warmup=2)
    row = bench.summarize(point, steps, 1.0, 0)
    assert row["tps"] == 20000.0 and row["step_s"] == 5.0 and row["profiled_steps_left_out"] == 4
    unprofiled = bench.summarize(dataclasses.replace(point, args=()), steps, 1.0, 0)
    assert unprofiled["tps"] == 15000.0 and "profiled_steps_left_out" not in unprofiled
    # every step after warm-up profiled: all of them count (a figure, not an empty row)
    late = bench.summarize(dataclasses.replace(point, warmup=7), steps, 1.0, 0)
    assert late["tps"] == 10000.0


def test_moe_field_of_step_lines():
    bench = _script("bench_scaling")
    line = OMNI_LINE + "  moe: max/mean 1.84 (layer 3) dropped 1,204 (0.52%)"
    (step,) = bench.parse_steps(line)
    assert step["max_over_mean"] == 1.84 and step["dropped_pct"] == 0.52 and step["tps"] == 4424.0
    point = bench.Point("m", "x.toml", 4, 8192, warmup=1)
    row = bench.summarize(point, [dict(step, step=2, mfu=0.0)], 1.0, 0)  # no MFU: no config read
    assert row["dropped_pct"] == 0.52
    assert "| m | 1.84 | 0.52% |" in bench.table([row], "test")
    names = [p.name for p in bench.PLANS["moe_dispatch_4gpu"]]
    assert "moe_12L_8k_4gpu_cap1.25_compile" in names
    assert {"moe_12L_8k_4gpu_cap1.25_chunks2", "moe_12L_8k_4gpu_cap1.25_chunks2_compile"} <= set(
        names)
    assert "moe_4L_8k_2gpu_cap1.25_chunks2" in [p.name for p in bench.PLANS["moe_dispatch_2gpu"]]
    assert not [p for p in bench.PLANS["moe_dispatch_1gpu"] if "chunks" in p.name]


def _trace_summary(trace, tmp_path, events: list[dict]) -> str:
    """``summarize_trace.summarize`` of a trace file holding ``events``."""
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return trace.summarize(str(path))


def test_trace_summary_counts_busy_time_and_gaps(tmp_path):
    trace = _script("summarize_trace")
    events = [
        {"name": "ProfilerStep#5", "cat": "user_annotation", "ts": 0, "dur": 40000},
        {"name": "aten::_local_scalar_dense", "cat": "cpu_op", "ts": 11000, "dur": 9000},
        {"name": "nvjet_sm90_tst_256x128", "cat": "kernel", "ts": 10000, "dur": 1000},
        {"name": "nvjet_sm90_tst_256x128", "cat": "kernel", "ts": 10500, "dur": 1000},  # overlaps
        {"name": "flash_fwd_kernel", "cat": "kernel", "ts": 21500, "dur": 500},
        {"name": "ncclDevKernel_AllGather_RING_LL", "cat": "kernel", "ts": 12000, "dur": 9000},
        # the .item() waits in the gap; a later sync outside the kernels' window is not counted
        {"name": "cudaStreamSynchronize", "cat": "cuda_runtime", "ts": 11500, "dur": 8000},
        {"name": "cudaStreamSynchronize", "cat": "cuda_runtime", "ts": 30000, "dur": 10},
        # the allocator giving memory back: cudaFree waits for the device
        {"name": "cudaFree", "cat": "cuda_runtime", "ts": 13000, "dur": 2500},
        {"name": "cudaFree", "cat": "cuda_runtime", "ts": 16000, "dur": 500},
    ]
    text = _trace_summary(trace, tmp_path, events)
    # window 10.0-22.0 ms; compute busy 1.5 + 0.5 ms; one 10 ms gap opened by the sync
    assert "GPU window 12.0 ms, compute kernels busy 2.0 ms (17%)" in text
    assert "communication kernels 9.0 ms" in text
    assert "gaps >= 2 ms: 10.0 ms (1 gaps)" in text
    assert "10.0 ms  cudaStreamSynchronize < aten::_local_scalar_dense" in text
    assert "host syncs in the GPU window: 1" in text
    assert "1x  cudaStreamSynchronize in aten::_local_scalar_dense" in text
    assert "2x  cudaFree (3.0 ms on the host)" in text
    assert "compiling on this host" not in text  # nothing compiled in this window


def test_trace_summary_names_the_ops_whose_kernels_loaded_lazily(tmp_path):
    """CUPTI's "Lazy Function Loading" events, each under the op that launched the kernel: the
    twenty-third session's audio backward waited 194 ms in one ``aten::mm`` for such a load."""
    trace = _script("summarize_trace")
    events = [
        {"name": "nvjet_sm90_tst_256x128", "cat": "kernel", "ts": 0, "dur": 9000},
        {"name": "aten::addmm", "cat": "cpu_op", "ts": 1000, "dur": 300},
        {"name": "CompiledFunctionBackward", "cat": "cpu_op", "ts": 1900, "dur": 7600},
        {"name": "aten::mm", "cat": "cpu_op", "ts": 2000, "dur": 7200},  # the innermost op
        {"name": "Lazy Function Loading", "cat": "overhead", "ts": 9050, "dur": 100},
        {"name": "nvjet_sm90_tst_128x208", "cat": "kernel", "ts": 9300, "dur": 500},
        # after the recorded kernels: not this window's
        {"name": "Lazy Function Loading", "cat": "overhead", "ts": 20000, "dur": 100},
    ]
    text = _trace_summary(trace, tmp_path, events)
    assert "kernels loaded at their first launch in the GPU window: 1" in text
    assert "7.2 ms  aten::mm at 9.1 ms" in text
    assert "aten::addmm at" not in text
    events = [e for e in events if e["cat"] != "overhead"]
    assert "first launch in the GPU window" not in _trace_summary(trace, tmp_path, events)


def test_trace_summary_reports_the_hosts_compiling(tmp_path):
    """A rank compiling mid-run stalls every rank; its own trace says so (call 3 of the
    eighteenth session: rank 1 compiled 6.55 s in step 14 while rank 0 waited in a gather)."""
    trace = _script("summarize_trace")
    events = [
        {"name": "nvjet_sm90_tst_256x128", "cat": "kernel", "ts": 0, "dur": 1000},
        {"name": "dynamo", "cat": "user_annotation", "ts": 2000, "dur": 6000},
        {"name": "CachingAutotuner.benchmark_all_configs (dynamo_timed)",
         "cat": "user_annotation", "ts": 5000, "dur": 2500},
        {"name": "CachingAutotuner.benchmark_all_configs (dynamo_timed)",
         "cat": "user_annotation", "ts": 9000, "dur": 500},
        # after the recorded kernels: not this window's
        {"name": "dynamo", "cat": "user_annotation", "ts": 20000, "dur": 6000},
        {"name": "flash_fwd_kernel", "cat": "kernel", "ts": 10000, "dur": 500},
    ]
    text = _trace_summary(trace, tmp_path, events)
    assert ("compiling on this host in the GPU window: 1 frame compile(s), 6.0 ms; 2 kernel "
            "autotuning(s) at first launch, 3.0 ms") in text


def test_trace_summary_counts_the_compiled_graphs_calls(tmp_path):
    """Each compiled call costs the host a dynamo entry and a generated wrapper: the summary
    counts them by graph, most called first (the forty-first session's optimizer step made 62
    calls, one per tensor), from the host's ranges only (the GPU's copy of a range is not a
    call)."""
    trace = _script("summarize_trace")
    call = "## Call CompiledFxGraph {} (code id)"
    events = [
        {"name": "nvjet_sm90_tst_256x128", "cat": "kernel", "ts": 0, "dur": 1000},
        *({"name": call.format("updateaaaaaaaaaaaaaaaa"), "cat": "user_annotation",
           "ts": 100 * i, "dur": 200} for i in range(3)),
        {"name": call.format("blockbbbbbbbbbbbbbbbbb"), "cat": "user_annotation", "ts": 900,
         "dur": 4000},
        {"name": call.format("blockbbbbbbbbbbbbbbbbb"), "cat": "gpu_user_annotation",
         "ts": 950, "dur": 4000},
        *({"name": "TorchDynamo Cache Lookup", "cat": "user_annotation", "ts": 100 * i,
           "dur": 50} for i in range(4)),
    ]
    text = _trace_summary(trace, tmp_path, events)
    lines = text.splitlines()
    at = lines.index("  compiled graphs' calls on the host: 4 calls of 2 graphs, 4.6 ms in "
                     "their generated code; dynamo's cache lookups: 4, 0.2 ms; the most called "
                     "graphs (calls, host time, per call):")
    assert [line.split() for line in lines[at + 1:at + 3]] == [
        ["3x", "0.6", "ms", "0.20", "ms", "updateaaaaaaaaaa"],
        ["1x", "4.0", "ms", "4.00", "ms", "blockbbbbbbbbbbb"]]


def test_trace_summary_splits_the_timeline_by_part(tmp_path):
    trace = _script("summarize_trace")

    def host(name, ts, tid, dur=1, cat="user_annotation"):
        return {"name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid}

    def launch(corr, ts, tid):  # a Triton kernel's launch is a driver call
        cat, name = ("cuda_driver", "cuLaunchKernelEx") if corr == 6 else (
            "cuda_runtime", "cudaLaunchKernel")
        return {"name": name, "cat": cat, "ts": ts, "dur": 1, "tid": tid,
                "args": {"correlation": corr}}

    def kernel(corr, ts, dur, name="nvjet_gemm"):
        return {"name": name, "cat": "kernel", "ts": ts, "dur": dur, "args": {"correlation": corr}}

    main, grad = 1, 2
    events = [
        host("FSDP::pre_forward (encoders.vision.blocks.0)", 0, main), launch(1, 1, main),
        host("FSDP::pre_forward (llm.layers.0)", 10, main), launch(2, 11, main),
        # the backward thread: a pre-backward, then a checkpoint's recompute (a pre-forward
        # inside the autograd engine counts as backward)
        host("FSDP::pre_backward (llm.layers.0)", 20, grad), launch(3, 21, grad),
        host("autograd::engine::evaluate_function: CheckpointFunctionBackward", 29, grad, 10,
             "cpu_op"),
        host("FSDP::pre_forward (encoders.vision.blocks.0)", 30, grad), launch(4, 31, grad),
        launch(7, 32, grad),
        # the optimizer step, then the main thread is back in its latest unit
        host("Optimizer.step#AdamW.step", 50, main, 10), launch(5, 52, main),
        launch(6, 61, main),
        kernel(1, 1000, 1000), kernel(2, 5000, 2000), kernel(3, 8000, 1000),
        kernel(4, 9500, 500), kernel(7, 9600, 3000, "ncclDevKernel_AllGather_RING_LL"),
        kernel(5, 12000, 1000), kernel(6, 13000, 500),
        # the step starts before the first unit: data (with a nested op), then the inputs
        host("ProfilerStep#20", -30, main, 100), host("next(data)", -28, main, 20, "cpu_op"),
        host("aten::copy_", -27, main, 5, "cpu_op"), host("model_inputs", -6, main, 4),
        # the vision forward's ops: a top-level linear (its addmm nested) and two adds
        host("aten::linear", 2, main, 5, "cpu_op"), host("aten::addmm", 3, main, 2, "cpu_op"),
        host("aten::add", 7, main, 1, "cpu_op"), host("aten::add", 8, main, 1, "cpu_op"),
    ]
    text = _trace_summary(trace, tmp_path, events)
    device_part, host_part = text.split("  by part (kernels")[1].split("  host by part")
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in device_part.splitlines()[2:]}
    # timeline, computing, idle, communication (ms), kernels of each part and pass, and the
    # host's lead: the median from a compute kernel's launch call's end to its start (the llm
    # forward's: 5,000 - 12 and 13,000 - 62 us; the vision backward's all-gather not counted)
    expected = {
        ("encoders.vision", "forward"): ["1.0", "1.0", "0.0", "0.0", "1", "1.0"],
        ("llm", "forward"): ["5.5", "2.5", "3.0", "0.0", "2", "9.0"],
        ("llm", "backward"): ["2.0", "1.0", "1.0", "0.0", "1", "8.0"],
        ("encoders.vision", "backward"): ["1.0", "0.5", "0.5", "3.0", "2", "9.5"],
        ("optimizer", "step"): ["3.0", "1.0", "2.0", "0.0", "1", "11.9"],
    }
    assert {k: [x for x in v if x != "ms"] for k, v in rows.items()} == expected, rows
    # the timelines add up to the compute window (1.0 to 13.5 ms)
    assert sum(float(v[0]) for v in expected.values()) == 12.5
    # the host: each thread's time from a part's mark to its next mark (the main thread's last
    # to its last event, the step's end at 70 us; the backward thread's to the recompute's end
    # at 39 us) and the launches queued there (a driver launch too)
    host_rows = {tuple(line.split()[:2]): line.split()[2:] for line in
                 host_part.split("  encoders.vision forward, longest")[0].splitlines()[2:]}
    assert {k: (v[6], v[7]) for k, v in host_rows.items()} == {
        ("encoders.vision", "forward"): ("1", "10.0"), ("llm", "forward"): ("2", "25.0"),
        ("llm", "backward"): ("1", "10.0"), ("encoders.vision", "backward"): ("2", "4.5"),
        ("optimizer", "step"): ("1", "10.0"),
    }, host_rows
    # the vision forward's top-level ops (the nested addmm is in its linear), by total time
    ops = host_part.split("encoders.vision forward, longest top-level ops")[1].split(
        "  host before")[0].splitlines()[1:]
    assert [line.split("ms")[1].split() for line in ops] == [["1x", "aten::linear"],
                                                              ["2x", "aten::add"]]
    before = host_part.split("host before")[1].splitlines()
    assert "0.0 ms of it in top-level host ops; the longest:" in before[0]  # 30 us, 24 us
    assert [line.split("ms")[1].strip() for line in before[1:]] == ["next(data)", "model_inputs"]


def test_trace_summary_splits_host_time_into_ops_and_outside():
    trace = _script("summarize_trace")

    def ev(name, ts, dur, cat="cpu_op", **args):
        return {"name": name, "cat": cat, "ts": ts, "dur": dur, "tid": 1, "args": args}

    events = [
        ev("FSDP::pre_forward (encoders.vision)", 0, 10, "user_annotation"),
        ev("aten::linear", 1000, 3000), ev("aten::addmm", 1500, 2000),  # nested: not twice
        ev("aten::add", 5000, 1000),
        *[ev("cudaLaunchKernel", t, d, "cuda_runtime", correlation=i)
          for i, (t, d) in enumerate(((1600, 5), (5100, 300), (5400, 5)))],
        ev("FSDP::pre_forward (llm.layers.0)", 10000, 10, "user_annotation"),
        ev("aten::mm", 10500, 500),
    ]
    text = "\n".join(trace.host_by_part(events))
    row = next(line.split() for line in text.splitlines()
               if line.split()[:2] == ["encoders.vision", "forward"])
    # 10 ms in the part: 4 ms inside top-level ops (3 + 1), 6 ms outside; 3 launches, one of
    # which waited 0.3 ms for room in the launch queue
    assert row[2:] == ["10.0", "ms", "4.0", "ms", "6.0", "ms", "3", "3333.3", "us",
                       "1", "0.3", "ms"], row


def test_ratios_pair_each_variant_with_its_own_baseline():
    """Two exchanges measured in one call (2026-11-26, 4x H100): each toy row's long-text
    reference is the row with the same flags, not whichever long-text row came last."""
    bench = _script("bench_scaling")
    stem = "moe_12L_8k_ep4"
    rows = [_row(f"{stem}_long_text_exact_log10", 15290.0, workload="long_text"),
            _row(f"{stem}_toy_exact_log10", 11500.0, workload="toy"),
            _row(f"{stem}_long_text_exact_log10_nvshmem", 14004.0, workload="long_text"),
            _row(f"{stem}_toy_exact_log10_nvshmem", 11690.0, workload="toy"),
            # no long-text row of its variant: the plainest long-text row of the same model
            _row(f"{stem}_toy_exact_log10_encoders_replicated", 7645.0, workload="toy")]
    bench.add_ratios(rows)
    by = {r["name"]: r.get("vs_long_text") for r in rows}
    assert by[f"{stem}_toy_exact_log10"] == pytest.approx(11500 / 15290)
    assert by[f"{stem}_toy_exact_log10_nvshmem"] == pytest.approx(11690 / 14004)
    assert by[f"{stem}_long_text_exact_log10_nvshmem"] == 1.0
    assert by[f"{stem}_toy_exact_log10_encoders_replicated"] == pytest.approx(0.5)


def _omni_line(step: int, stamp: str, tps: int) -> str:
    return (f"[rank0]:[titan] 2026-11-23 {stamp} - root - INFO - step: {step}  loss:  7.1 "
            f"(text: 7.1)  grad_norm:  4.2  memory: 70.00GiB(50.00%)  tps: {tps:,}  "
            f"tflops: 200.00  mfu: 20.00%")


# what dynamo prints under TORCH_LOGS=recompiles (torch 2.13), as torchrun's tee shows it
RECOMPILE_LINES = [
    "[rank0]:V1123 13:12:22.874000 25037 site-packages/torch/_dynamo/guards.py:5396] [0/1] "
    "[__recompiles] Recompiling function forward in /repo/torchtitan_omni/omni_model.py:120",
    "[rank0]:V1123 13:12:22.874000 25037 site-packages/torch/_dynamo/guards.py:5396] [0/1] "
    "[__recompiles]     triggered by the following guard failure(s):",
    "[rank0]:V1123 13:12:22.874000 25037 site-packages/torch/_dynamo/guards.py:5396] [0/1] "
    "[__recompiles]     - 0/0: tensor 'tokens' size mismatch at index 1. expected 7776, "
    "actual 7768",
]


def test_step_time_and_recompiles_of_a_compiled_point():
    bench = _script("bench_scaling")
    stamps = ["10:00:00,000", "10:00:30,000", "10:00:31,500", "10:00:32,700", "10:00:33,900",
              "10:00:36,400"]
    lines = [_omni_line(i + 1, t, 4000 + i) for i, t in enumerate(stamps)]
    log = "\n".join(lines[:3] + RECOMPILE_LINES + lines[3:] + RECOMPILE_LINES[:1])
    steps = bench.parse_steps(log)
    # steps 3-6 took 1.5, 1.2, 1.2 and 2.5 s (step 2's 30 s of start-up is warm-up)
    assert bench.step_time(steps, warmup=2) == pytest.approx(1.35)
    assert bench.step_time(steps, warmup=6) is None
    # a line every 10 steps (log_freq 10): each gap over the 10 steps it spans
    sparse = [{"step": k, "time": t} for k, t in ((1, 0.0), (10, 40.0), (20, 52.0), (30, 62.0))]
    assert bench.step_time(sparse, warmup=10) == pytest.approx(1.1)  # 1.2 and 1.0 s per step
    assert bench.count_recompiles(log) == 2
    eager = bench.Point("p", "train_configs/llama_omni_8B.toml", 1, 8192, warmup=2)
    row = bench.summarize(eager, steps[:2], 10.0, 0, log)
    assert row["recompiles"] is None and "tps" not in row  # no step after warm-up
    row = bench.summarize(bench.compiled(eager), [], 10.0, 0, log)
    assert row["recompiles"] == 2 and row["compile"] and row["name"] == "p_compile"


def test_non_colocated_point_runs_a_derived_config_and_counts_every_gpu(tmp_path):
    """A point with encoders on their own ranks: its TOML is the config plus each encoder's
    ranks table (parsed as the trainer parses it), the log read is the first LLM rank's, and
    its per-GPU figures are over every GPU (the LLM ranks' line counts their own only)."""
    bench = _script("bench_scaling")
    point = next(p for p in bench.PLANS["hetero_4gpu"]
                 if p.name == "omni_8B_8k_noncolocated_1+3_pipelined")
    env = point.environment()
    assert env["LOG_RANK"] == "1" and env["NGPU"] == "4"
    path = os.path.join(bench.REPO, env["CONFIG_FILE"])
    with open(path, "rb") as f:
        cfg = tomllib.load(f)
    assert cfg["parallelism"]["parts"] == {"encoders.vision": {"ranks": [0]},
                                           "encoders.audio": {"ranks": [0]}}
    assert cfg["model"]["flavor"] == "8B"  # the rest is the 8B config's
    cmd = point.command()
    assert cmd[cmd.index("--parallelism.encoder_schedule") + 1] == "pipelined"
    assert cmd[cmd.index("--training.global_batch_size") + 1] == "6"  # 2 micro-batches x 3
    lines = [_omni_line(i + 1, f"10:00:{10 + 3 * i:02d},000", 4000) for i in range(8)]
    row = bench.summarize(point, bench.parse_steps("\n".join(lines)), 60.0, 0)
    assert row["tps"] == 3000 and row["mfu"] == 15.0  # 3 of the 4 GPUs' line
    assert "WORLD_SIZE" not in os.environ  # the TorchTitan-formula MFU's parse leaves none
    assert bench.PLANS["hetero_4gpu"][0].gpu_share() == 1.0


def _row(name, tps, ngpu=1, seq=8192, compile=False, stock=False, workload="realistic",
         config="omni.toml"):
    return {"name": name, "tps": tps, "ngpu": ngpu, "seq_len": seq, "compile": compile,
            "stock": stock, "workload": "text" if stock else workload, "config": config,
            "rc": 0, "command": "x", "mfu": 20.0, "mem_gib": 70.0, "step_s": 1.0,
            "recompiles": 3 if compile else None}


def test_float8_rows_are_compared_with_float8_rows():
    """2x H200, 2026-11-27: the omni float8 text row against stock TorchTitan in float8, not
    the bf16 stock row of the same GPUs, seq and compile setting (that would credit the omni
    trainer with float8's gain)."""
    bench = _script("bench_scaling")
    float8 = shlex.join(bench.FLOAT8)
    rows = [_row("stock_compile", 8679.0, compile=True, stock=True, config="8B"),
            _row("stock_compile_float8", 10914.0, compile=True, stock=True, config="8B"),
            _row("text_only_compile", 10419.0, compile=True, workload="text"),
            _row("text_only_compile_float8", 13174.0, compile=True, workload="text"),
            _row("realistic_compile_float8", 8039.0, compile=True)]
    for r in rows:
        r["command"] = f"./run_train.sh {float8 if r['name'].endswith('float8') else ''}"
    bench.add_ratios(rows)
    by = {r["name"]: r for r in rows}
    assert by["text_only_compile"]["vs_stock"] == pytest.approx(10419 / 8679)
    assert by["text_only_compile_float8"]["vs_stock"] == pytest.approx(13174 / 10914)
    assert by["realistic_compile_float8"]["vs_text"] == pytest.approx(8039 / 13174)


def test_ratios_pair_points_of_the_same_gpus_seq_model_and_compile_setting():
    bench = _script("bench_scaling")
    rows = [
        _row("stock", 8000.0, stock=True, config="8B_16L"),
        _row("text", 9000.0, workload="text"),
        _row("long_text", 8000.0, workload="long_text"),
        _row("realistic", 4000.0),
        _row("moe", 3000.0, config="moe.toml"),  # another model: no text-only reference
        _row("realistic_32k", 2000.0, seq=32768),  # no reference at 32K
        _row("stock_compile", 10000.0, stock=True, compile=True, config="8B_16L"),
        _row("realistic_compile", 5000.0, compile=True),  # no compiled text-only point
        {"name": "skipped", "ngpu": 1, "seq_len": 8192, "command": "x",
         "status": "not run (deadline)"},
    ]
    bench.add_ratios(rows)
    by = {r["name"]: r for r in rows}
    assert by["stock"]["vs_stock"] == 1.0 and by["text"]["vs_text"] == 1.0
    assert by["realistic"]["vs_stock"] == 0.5 and by["realistic"]["vs_text"] == pytest.approx(4 / 9)
    assert by["realistic"]["vs_long_text"] == 0.5
    assert by["long_text"]["vs_text"] == pytest.approx(8 / 9)
    assert "vs_long_text" not in by["moe"] and "vs_long_text" not in by["realistic_compile"]
    assert by["moe"]["vs_stock"] == 3000 / 8000 and "vs_text" not in by["moe"]
    assert "vs_stock" not in by["realistic_32k"] and "vs_text" not in by["realistic_32k"]
    assert by["realistic_compile"]["vs_stock"] == 0.5 and "vs_text" not in by["realistic_compile"]
    by["realistic"]["media_share"] = 0.498
    by["stock"]["media_share"] = 0.0
    text = bench.table(rows, "test device")
    line = next(x for x in text.splitlines() if x.startswith("| realistic |"))
    assert ("| realistic (50%) | no | 4,000 | - | 0.50x | 0.44x | 0.50x | 20.0% | - | 1.00 | 70.0 "
            "| - | ok |") in line
    line = next(x for x in text.splitlines() if x.startswith("| realistic_compile |"))
    assert "| yes | 5,000 | - | 0.50x | - | - |" in line and line.endswith("| 3 | ok |")
    assert "| long_text | 1 | 8K | long text | no | 8,000 | - | 1.00x | 0.89x | 1.00x |" in text
    assert "| stock | 1 | 8K | text | no | 8,000 | - | 1.00x | - |" in text
    assert "| skipped | 1 | 8K | - | no | - | - | - | - |" in text and "not run (deadline)" in text


def test_plans_and_the_compile_filters():
    bench = _script("bench_scaling")
    plan = bench.build_plans(llm_layers=8)["omni_1gpu"]
    assert {p.workload for p in plan} == {"text", "realistic", "toy"}
    # the four points eager and compiled, text and realistic rows compiled with the optimizer
    # too, and the compiled realistic rows by the encoders' work
    assert sum(p.stock for p in plan) == 2 and sum(p.compile for p in plan) == 7
    assert sorted(p.name for p in plan if p.name.endswith("_opt")) == [
        "omni_8B_8L_8k_realistic_compile_opt", "omni_8B_8L_8k_text_only_compile_opt"]
    work = plan[-1]
    assert work.name == "omni_8B_8L_8k_realistic_compile_work_order" and work.compile
    cmd = work.command()
    assert cmd[cmd.index("--omni.encoder_order") + 1] == "work"
    for p in plan:
        assert p.ngpu == 1 and p.seq_len == 8192
        cmd = p.command()
        if p.stock:
            assert cmd[cmd.index("--model.flavor") + 1] == "8B_8L"
            assert cmd[cmd.index("--experimental.custom_import") + 1] == bench.FLAVORS_MODULE
        else:
            assert cmd[cmd.index("--omni.llm_layers") + 1] == "8"
        assert ("--compile.enable" in cmd) == p.compile
        assert (p.environment().get("TORCH_LOGS") == "recompiles") == p.compile
    realistic = next(p for p in plan if p.workload == "realistic")
    assert "image,video,audio" in realistic.command()
    assert realistic.dataset() == "data/realistic/llama_omni_8B_8k"
    assert "--workload realistic" in " ".join(realistic.build_command())
    assert [p.compile for p in bench.select(plan, "", True, False)] == [False] * 4
    assert [p.compile for p in bench.select(plan, "", False, True)] == [True] * 7
    assert [p.name for p in bench.select(plan, "omni_8B_8L_8k_toy", False, False)] == [
        "omni_8B_8L_8k_toy"]
    with pytest.raises(SystemExit, match="no point nope"):
        bench.select(plan, "nope", False, False)
    two = bench.PLANS["omni_2gpu"]
    assert {(p.workload, p.seq_len, p.stock) for p in two if not p.compile} == {
        ("text", 8192, True), ("text", 8192, False), ("long_text", 8192, False),
        ("realistic", 8192, False),
        ("toy", 8192, False), ("realistic", 32768, False), ("realistic", 65536, False),
        ("realistic", 131072, False)}
    long_text = next(p for p in two if p.workload == "long_text" and not p.compile)
    assert long_text.dataset() == "data/long_text/llama_omni_8B_8k"
    assert "--workload text" in " ".join(long_text.build_command())
    assert "--data.modalities" not in long_text.command()
    assert "--data.buffer_docs" in long_text.command()  # packed one document per row
    offload = next(p for p in two if p.seq_len == 131072).command()
    assert "--omni.activation_offload" in offload and "--training.enable_cpu_offload" in offload
    sp2 = next(p for p in two if p.seq_len == 32768).command()
    assert sp2[sp2.index("--parallelism.ulysses_degree") + 1] == "2"
    assert "--parallelism.encoder_sequence_parallel" in sp2
    hetero = bench.PLANS["hetero_2gpu"]
    modes = [p.command()[p.command().index("--parallelism.encoder_sequence_parallel") + 1]
             for p in hetero if "--parallelism.encoder_sequence_parallel" in p.command()]
    assert sorted(modes) == ["balance", "balance", "balance", "replicate", "split"]
    assert {p.workload for p in hetero} == {"realistic"} and {p.ngpu for p in hetero} == {2}


def test_cut_llama3_flavors_of_stock_torchtitan():
    """scripts/titan_flavors.py, imported as stock runs import it (from the repository root):
    Llama-3-8B with fewer layers, registered where TorchTitan's llama3 spec reads flavors."""
    flavors = importlib.import_module("scripts.titan_flavors")
    from torchtitan.protocols.train_spec import get_train_spec

    assert flavors.LAYER_CUTS == _script("bench_scaling").LAYER_CUTS
    args = get_train_spec("llama3").model_args
    for n in flavors.LAYER_CUTS:
        cut = args[flavors.flavor_name(n)]
        assert cut.n_layers == n and cut is not args["8B"]
        assert {**vars(cut), "n_layers": 32} == vars(args["8B"])
    assert args["8B"].n_layers == 32


def test_long_text_rows_with_media_are_refused_before_any_point_runs(tmp_path, monkeypatch):
    """The long-text baseline must hold no media: a dataset whose manifest says otherwise (a
    builder that put the toy media in) stops the run before it spends GPU time."""
    bench = _script("bench_scaling")
    monkeypatch.setattr(bench, "REPO", str(tmp_path))
    point = next(p for p in bench.PLANS["llama_4gpu"] if p.workload == "long_text")
    folder = tmp_path / point.dataset()
    folder.mkdir(parents=True)
    manifest = {"arguments": point.build_command()[2:], "media_share": 0.0067}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SystemExit, match="long-text rows hold media"):
        bench.prepare_data([point])
    manifest["media_share"] = 0.0
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert bench.prepare_data([point])[0] == []  # built already, nothing to build


def test_launch_queue_probe_finds_the_first_blocked_launch_and_needs_a_gpu():
    probe = _script("probe_launch_queue")
    fast, slow = 5e-6, 1e-3
    assert probe.launches_before_blocking([fast] * 1021 + [slow, fast, slow], 2e-4) == 1021
    assert probe.launches_before_blocking([fast] * 50, 2e-4) is None
    if not torch.cuda.is_available():
        run = subprocess.run([sys.executable, "scripts/probe_launch_queue.py"], cwd=REPO,
                             capture_output=True, text=True)
        assert run.returncode == 1
        assert run.stderr.strip() == "probe_launch_queue: needs a CUDA GPU (none is visible)"


def test_attention_benchmark_smoke_times_device_and_host_and_checks_against_reference():
    bench = _script("bench_attention")
    rows = bench.main(["--smoke", "--iters", "2", "--warmup", "1"])
    ran = [r for r in rows if "error" not in r]
    # on CPU the whole-row and grouped SDPA candidates run; the CUDA-only ones report why not
    assert {(r["case"], r["kernel"]) for r in ran} >= {("llm single doc", "sdpa_flash"),
                                                      ("vision items", "sdpa_grouped")}
    for r in ran:
        assert r["rel_err"] < 1e-5 and r["grad_err"] < 1e-5, r
        assert r["ms"] > 0 and r["host_ms"] > 0, r
    kernels = {r["kernel"] for r in rows}
    assert {"varlen_fa2", "varlen_aten"} <= kernels
    # grouped k/v heads are offered to cuDNN as they are where the heads differ
    assert ("llm single doc", "sdpa_cudnn_kv_heads") in {(r["case"], r["kernel"]) for r in rows}
    assert "sdpa_cudnn_kv_heads" not in {r["kernel"] for r in rows if r["case"] == "vision items"}
    if not torch.cuda.is_available():
        _refuses_without_a_gpu("bench_attention")


def test_attention_benchmark_runs_the_cases_it_is_asked_for():
    bench = _script("bench_attention")
    rows = bench.main(["--smoke", "--iters", "1", "--warmup", "0", "--only", "packed"])
    assert {r["case"] for r in rows} == {"llm packed"}
    with pytest.raises(SystemExit, match="no case name contains 'nothing'"):
        bench.main(["--smoke", "--only", "nothing"])


def test_tables_state_the_launch_queues_each_kind_of_point_ran_with():
    bench = _script("bench_scaling")
    assert bench.launch_queues({}) == ("CUDA_SCALE_LAUNCH_QUEUES=4x for omni points "
                                       "(run_train.sh), the driver's default for stock points")
    assert bench.launch_queues({"CUDA_SCALE_LAUNCH_QUEUES": "2x"}) == (
        "CUDA_SCALE_LAUNCH_QUEUES=2x for every point")
    assert bench.launch_queues({"CUDA_SCALE_LAUNCH_QUEUES": ""}) == bench.launch_queues({})


def test_encoder_graph_benchmark_runs_what_the_encoder_runs():
    bench = _script("bench_encoder_graphs")
    rows = bench.main(["--smoke", "--iters", "1", "--warmup", "0"])
    assert [r["mode"] for r in rows] == ["eager"]  # graphs need CUDA
    # the graphable wrapper (tensors in, attention metadata rebuilt) is the encoder's lm_encode
    assert rows[0]["vs_lm_encode"] == 0.0
    assert rows[0]["patches"] == 20 and rows[0]["host_ms"] > 0
    if not torch.cuda.is_available():
        _refuses_without_a_gpu("bench_encoder_graphs")


def test_pyspy_summary_counts_threads_queue_waits_and_encoder_samples():
    spy = _script("summarize_pyspy")
    raw = [
        "thread (7): MainThread;run (torchtitan_omni/train.py:10);"
        "lm_encode (torchtitan_omni/encoders/vision.py:240);linear (torch/nn/functional.py:5) 5",
        "thread (7): MainThread;run (torchtitan_omni/train.py:10);step (torch/optim/adamw.py:3) 3",
        # the autograd thread: a launch waiting for room in the queue, and one that did not
        "thread (9);Engine::thread_main (libtorch_cpu.so);cudaLaunchKernel (libcudart.so);"
        "cuLaunchKernel (libcuda.so);sched_yield (libc.so.6) 6",
        "thread (9);Engine::thread_main (libtorch_cpu.so);cudaLaunchKernel (libcudart.so) 2",
        "thread (9);sched_yield (libc.so.6) 1",  # a yield outside a launch is not a queue wait
        "",
    ]
    stacks = spy.read_raw([line + "\n" for line in raw])
    lines = spy.summarize(stacks, top=2)
    assert lines[0] == "17 samples"
    rows = {line[:36].strip(): line[36:].split() for line in lines[2:4]}
    assert rows == {"thread 9": ["9", "52.9%", "6", "(", "66.7%)", "0"],
                    "MainThread (7)": ["8", "47.1%", "0", "(", "0.0%)", "5"]}, rows
    main_at = lines.index("  innermost Python frames, MainThread (7):")
    inclusive_at = lines.index("  inclusive Python frames (anywhere on the stack), "
                               "MainThread (7):")
    assert [line.split(None, 1) for line in lines[main_at + 1:inclusive_at]] == [
        ["5", "linear (torch/nn/functional.py)"], ["3", "step (torch/optim/adamw.py)"]]
    # run() holds all 8 of the thread's samples, the encoder with what it calls 5 (top 2)
    regions_at = lines.index("  regions, thread 9 (a sample counts in each region on its "
                             "stack):")
    assert [line.split(None, 2) for line in lines[inclusive_at + 1:regions_at]] == [
        ["8", "100.0%", "run (torchtitan_omni/train.py)"],
        ["5", "62.5%", "lm_encode (torchtitan_omni/encoders/vision.py)"]]
    assert not any("warning" in line for line in lines)
    with pytest.raises(ValueError, match="line 1 is not py-spy's raw format"):
        spy.read_raw(["thread (7): MainThread;frame\n"])
    # a sample taken while inductor still compiled (the fortieth session's: rank 0 sampled
    # 80 s after its start) is flagged as not steady state
    compiling = raw[:2] + [
        "thread (11): InductorSubproc;"
        "_recv_msg (torch/_inductor/compile_worker/subproc_pool.py:9) 6",
        "thread (12): subproc_worker_timer;check (torch/_inductor/compile_worker/timer.py:4) 6",
    ]
    lines = spy.summarize(spy.read_raw([line + "\n" for line in compiling]), top=2)
    assert any(line.startswith("  warning: 60% of the samples are inductor compiling")
               for line in lines), lines


def test_pyspy_regions_count_each_region_on_a_stack_and_give_ms_a_step():
    spy = _script("summarize_pyspy")
    graph = "Runner.call (" + "c" * 52 + ".py:40)"  # an inductor module, as py-spy names it
    aot = "forward (torch/_functorch/_aot_autograd/runtime_wrappers.py:3)"
    raw = [
        # a compiled block's forward launching a kernel: graphs, AOT wrappers and the launch
        f"thread (7): MainThread;train_step (torchtitan_omni/train.py:1);{aot};{graph};"
        "cuLaunchKernel (libcuda.so) 6",
        # FSDP's pre-forward all-gather: FSDP and c10d
        "thread (7): MainThread;train_step (torchtitan_omni/train.py:1);"
        "pre_forward (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py:9);"
        "all_gather_into_tensor (torch/distributed/distributed_c10d.py:4) 3",
        # the optimizer's compiled update: optimizer and the graph's code
        "thread (7): MainThread;step (torchtitan_omni/components/optimizer.py:236);"
        f"update_all (torchtitan_omni/components/adam_update.py:237);{graph} 2",
        "thread (7): MainThread;collect (torchtitan/utils.py:3);"
        "GarbageCollection.collect (torchtitan/tools/utils.py:5) 1",
        f"thread (9);Engine::thread_main (libtorch_cpu.so);{aot};{graph} 4",
    ]
    lines = spy.summarize(spy.read_raw([line + "\n" for line in raw]), top=1,
                          instants=40, step_ms=200)
    at = lines.index("  regions, MainThread (7) (a sample counts in each region on its stack); "
                     "ms a step of 200 ms:")
    table = {line[:36].strip(): line[36:].split() for line in lines[at + 1:at + 12]}
    # 12 busy samples of 40 instants: 30% of the time, 60 ms of a 200 ms step
    assert table["the thread, busy"] == ["12", "100.0%", "60.0"]
    assert table["compiled graphs' generated code"] == ["8", "66.7%", "40.0"]
    assert table["AOT autograd's runtime wrappers"] == ["6", "50.0%", "30.0"]
    assert table["kernel launches (driver)"] == ["6", "50.0%", "30.0"]
    assert table["FSDP's hooks"] == table["collectives (c10d)"] == ["3", "25.0%", "15.0"]
    assert table["optimizer (step, zero_grad, LR)"] == ["2", "16.7%", "10.0"]
    assert table["garbage collection"] == ["1", "8.3%", "5.0"]
    assert table["loss head"] == table["data loading"] == ["0", "0.0%", "0.0"]
    at = lines.index("  regions, thread 9 (a sample counts in each region on its stack); "
                     "ms a step of 200 ms:")
    assert lines[at + 2].split()[-3:] == ["4", "100.0%", "20.0"]  # the graphs' code
    # without the window and the step: shares only
    lines = spy.summarize(spy.read_raw([line + "\n" for line in raw]), top=1)
    at = lines.index("  regions, MainThread (7) (a sample counts in each region on its stack):")
    assert lines[at + 1].split()[-2:] == ["8", "66.7%"]


def _python_with_knobs(knobs: str, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "INDUCTOR_KNOBS": knobs,
           "PYTHONPATH": os.pathsep.join([str(REPO / "scripts" / "inductor_knobs"),
                                          os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)


def test_inductor_knobs_set_inductor_config_in_a_new_process_or_stop_it_in_one_line():
    """scripts/inductor_knobs/sitecustomize.py, as gpu_benchmarks.sh uses it (INDUCTOR_KNOBS):
    a process started with it has the settings before any code of its own runs."""
    run = _python_with_knobs(
        "combo_kernels=True, triton.cudagraphs=True,no_c_shim=aten._grouped_mm.default",
        "import torch._inductor.config as c\n"
        "from torchgen.aoti.fallback_ops import inductor_fallback_ops as ops\n"
        "print(c.combo_kernels, c.triton.cudagraphs, 'aten._grouped_mm.default' in ops,"
        " 'aten._scaled_grouped_mm.default' in ops)")
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True", "True", "False", "True"]
    for knobs, line in (
            ("combo_kernel=True", "INDUCTOR_KNOBS: torch._inductor.config has no combo_kernel"),
            ("triton.cudagraph=True", "INDUCTOR_KNOBS: torch._inductor.config has no "
                                      "triton.cudagraph"),
            ("combo_kernels", "INDUCTOR_KNOBS: 'combo_kernels' is not key=value"),
            ("combo_kernels=yes", "INDUCTOR_KNOBS: combo_kernels=yes: the value is not a "
                                  "Python literal"),
            ("no_c_shim=aten.mm.nothing", "INDUCTOR_KNOBS: no_c_shim=aten.mm.nothing: inductor "
                                          "has no C shim of that op")):
        run = _python_with_knobs(knobs, "print('ran')")
        assert (run.returncode, run.stdout, run.stderr.strip()) == (2, "", line), knobs


def test_inductor_knob_fallback_calls_the_op_instead_of_its_lowering():
    """``fallback=<op>`` (how the forty-sixth session ran the C++ wrapper on torch 2.11, which
    has no C shim of grouped GEMM): the compiled graph calls the aten op itself where inductor
    would otherwise pick its kernel (``extern_kernels._grouped_mm``), with the same result; an
    op inductor does not lower stops the process in one line."""
    code = (
        "import torch\n"
        "from torch._inductor.utils import run_and_get_code\n"
        "def f(x, w, offs):\n"
        "    return torch._grouped_mm(x, w, offs=offs).relu()\n"
        "x = torch.randn(12, 8, dtype=torch.bfloat16)\n"
        "w = torch.randn(3, 8, 8, dtype=torch.bfloat16)\n"
        "offs = torch.tensor([4, 8, 12], dtype=torch.int32)\n"
        "out, (src, *_) = run_and_get_code(torch.compile(f), x, w, offs)\n"
        "print(torch.equal(out, f(x, w, offs)), 'torch.ops.aten._grouped_mm.default(' in src,"
        " 'extern_kernels._grouped_mm(' in src)")
    lowered = _python_with_knobs("combo_kernels=False", code)
    assert lowered.returncode == 0, lowered.stderr
    assert lowered.stdout.split() == ["True", "False", "True"]
    fallen_back = _python_with_knobs("fallback=aten._grouped_mm.default", code)
    assert fallen_back.returncode == 0, fallen_back.stderr
    assert fallen_back.stdout.split() == ["True", "True", "False"]
    run = _python_with_knobs("fallback=aten.no_such_op.default", "print('ran')")
    assert (run.returncode, run.stdout, run.stderr.strip()) == (
        2, "", "INDUCTOR_KNOBS: fallback=aten.no_such_op.default: inductor has no lowering of "
               "that op")


def test_ep4_rank_flavor_of_the_moe_and_its_one_gpu_points():
    """scripts/omni_flavors.py, imported as the trainer imports it: 30B-A3B with a quarter of
    its experts (one EP4 rank's) and nothing else changed; the 1-GPU MoE points select it
    through the trainer's flags and validate (their FLOPs count 32 experts' routers)."""
    flavors = importlib.import_module("scripts.omni_flavors")
    from torchtitan.protocols.train_spec import get_train_spec

    args = get_train_spec("qwen3_moe_omni").model_args
    rank, full = args[flavors.EP4_RANK], args["30B-A3B"]
    assert rank.llm.num_experts == 32 and full.llm.num_experts == 128
    assert dataclasses.replace(rank.llm, num_experts=128) == full.llm
    assert rank.vision == full.vision and rank.audio == full.audio
    bench = _script("bench_scaling")
    points = bench.PLANS["moe_1gpu"]
    optimizer = ("_opt", "_opt_cc", "_opt_cc_m16", "_opt_w16_m16")
    assert sorted((p.seq_len, p.compile, p.workload, p.name.endswith(optimizer),
                   p.name.endswith(("_cc", "_cc_m16")), p.name.endswith("_m16"),
                   p.name.endswith("_w16_m16"))
                  for p in points) == [
        (8192, False, "text", False, False, False, False),
        (8192, True, "realistic", False, False, False, False),
        (8192, True, "realistic", True, False, False, False),
        (8192, True, "realistic", True, False, True, True),
        (8192, True, "realistic", True, True, False, False),
        (8192, True, "realistic", True, True, True, False),
        (8192, True, "text", False, False, False, False),
        (8192, True, "text", True, False, False, False),
        (8192, True, "text", True, False, True, True),
        (8192, True, "text", True, True, False, False),
        (8192, True, "text", True, True, True, False),
        (16384, False, "text", False, False, False, False),
        (16384, True, "text", False, False, False, False),
        (16384, True, "text", True, False, False, False),
        (16384, True, "text", True, False, True, True),
        (16384, True, "text", True, True, False, False),
        (16384, True, "text", True, True, True, False)]
    for p in points:
        cmd = p.command()
        components = cmd[cmd.index("--compile.components") + 1] if p.compile else None
        assert components == ("model,loss,optimizer" if p.name.endswith(optimizer)
                              else "model,loss" if p.compile else None), (p.name, cmd)
        assert ("--parallelism.expert_compute_copies" in cmd) == p.name.endswith(
            ("_cc", "_cc_m16"))
        assert ("--optimizer.moments_dtype" in cmd) == p.name.endswith("_m16"), p.name
        assert ("--optimizer.expert_weights_dtype" in cmd) == ("_w16" in p.name), p.name
        assert cmd[cmd.index("--model.flavor") + 1] == flavors.EP4_RANK, p.name
        assert cmd[cmd.index("--experimental.custom_import") + 1] == "scripts.omni_flavors"
        assert p.ngpu == 1 and bench.titan_flops_per_token(p) > 0
    # counting a 12-layer point's FLOPs leaves the registered flavors as they were
    assert rank.llm.n_layers == full.llm.n_layers == 48


def test_fixed_part_and_float8_points():
    """The MoE text points that split the step's fixed part (issue 12) set one AC mode each and
    the exchange they name, and the bf16 expert weights' points carry their flags and time 27
    steps; each float8 point of the 2- and 4-GPU plans is its bf16 compiled point's command
    with the float8 flags added."""
    bench = _script("bench_scaling")
    for plan in ("moe_2gpu", "moe_4gpu"):
        fixed = [p for p in bench.PLANS[plan] if p.name.endswith(("text_exact_no_ac",
                                                                  "text_exact_nvshmem"))]
        assert sorted(p.seq_len for p in fixed) == [8192, 8192, 16384, 16384], plan
        for p in fixed:
            cmd = p.command()
            modes = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--activation_checkpoint.mode"]
            assert modes == (["none"] if p.name.endswith("no_ac") else ["full"]), (p.name, modes)
            assert (bench.NVSHMEM[1] in cmd) == p.name.endswith("nvshmem"), p.name
        # the experts' weights in bf16: the gather pair with the compiled update, no copies,
        # 27 timed steps a point; on 2 GPUs also the realistic rows with the same settings
        w16 = [p for p in bench.PLANS[plan] if p.name.endswith("_w16_m16")]
        text = [p for p in w16 if "_text_" in p.name]
        assert sorted(p.seq_len for p in text) == [8192, 16384], plan
        assert [p.seq_len for p in w16 if "_realistic_" in p.name] == (
            [8192] if plan == "moe_2gpu" else []), plan
        for p in w16:
            cmd = p.command()
            assert "--optimizer.expert_weights_dtype" in cmd and "--optimizer.moments_dtype" in cmd
            assert "--parallelism.expert_compute_copies" not in cmd and "_gather_" in p.name
            assert (p.steps, p.warmup) == (30, 3) and p.compile, p.name
    for plan in ("omni_2gpu", "llama_4gpu"):
        by = {p.name: p for p in bench.PLANS[plan]}
        float8 = [p for p in by.values() if p.name.endswith("_float8")]
        assert len(float8) >= 3, plan
        for p in float8:
            bf16 = by[p.name.removesuffix("_float8")]
            assert p.compile and bf16.compile, p.name
            assert dataclasses.replace(p, name=bf16.name) == dataclasses.replace(
                bf16, args=bf16.args + bench.FLOAT8), p.name


def test_optimizer_benchmark_times_a_ranks_shard(capsys):
    """``bench_optimizer.py --smoke``: the rank's shard of the model's own parameters (each
    split over the ranks, the foundation cut to its layers), one row per rank count."""
    bench = _script("bench_optimizer")
    whole = bench.shard_numels("qwen3_moe_omni", "debugmodel", 2, 1)
    half = bench.shard_numels("qwen3_moe_omni", "debugmodel", 2, 2)
    assert len(half) == len(whole) and all(2 * h - 1 <= w <= 2 * h for h, w in zip(half, whole))
    assert sum(bench.shard_numels("qwen3_moe_omni", "debugmodel", 1, 1)) < sum(whole)
    bench.main(["--smoke", "--world", "2", "--world", "4"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith(("| 2 |", "| 4 |"))]
    assert [r[1] for r in rows] == [
        f"{sum(bench.shard_numels('qwen3_moe_omni', 'debugmodel', 2, n)) / 1e6:,.1f}M"
        for n in (2, 4)]
    assert all(float(r[2]) > 0 and min(map(float, r[3:8])) >= 0 for r in rows)  # ms
    if not torch.cuda.is_available():
        _refuses_without_a_gpu("bench_optimizer")


def test_trace_summary_leaves_the_previous_steps_tail_out_of_its_kernel_totals(tmp_path):
    """2x H200, 2026-11-27: a profiled MoE step's trace opened while the previous step's
    optimizer still ran; its kernels (launched before the trace, so without a launch call in
    it) doubled the optimizer's share of the top kernels. They are reported apart."""
    trace = _script("summarize_trace")
    adam = "multi_tensor_apply_kernel<FusedAdamMathFunctor>"
    events = [
        {"name": adam, "cat": "kernel", "ts": 0, "dur": 3000, "args": {"correlation": 7}},
        {"name": adam, "cat": "kernel", "ts": 20000, "dur": 3000, "args": {"correlation": 9}},
        {"name": "nvjet_sm90_gemm", "cat": "kernel", "ts": 5000, "dur": 10000,
         "args": {"correlation": 8}},
        *[{"name": "cudaLaunchKernel", "cat": "cuda_runtime", "ts": ts, "dur": 5,
           "args": {"correlation": c}} for ts, c in ((4000, 8), (19000, 9))],
    ]
    text = _trace_summary(trace, tmp_path, events)
    assert "GPU window 23.0 ms, compute kernels busy 16.0 ms" in text
    assert "queued before the trace opened" in text and "1 kernels, 3.0 ms, until 3.0 ms" in text
    top = text.split("top kernels:")[1].splitlines()
    assert "3.0 ms  " + adam in top[2] and "10.0 ms  nvjet_sm90_gemm" in top[1]
    assert "matmul              10.0 ms" in text and "other                3.0 ms" in text


def test_trace_fixed_part_of_two_token_counts(tmp_path):
    """``--fixed-part``: the same step at 1x and 2x the tokens; what does not grow is 2 x small -
    large, per kind, per kernel and for the step's span, compute and idle time (issue 12: the
    MoE step's fixed part, placed by kernel); the previous step's tail is left out."""
    trace = _script("summarize_trace")

    def step(path, scale):
        events, t, corr = [], 0, 0
        # the previous step's tail: no launch call in the trace
        events.append({"name": "nvjet_gemm", "cat": "kernel", "ts": 0, "dur": 50_000,
                       "args": {"correlation": 999}})
        t = 50_000
        for name, dur, gap in (("nvjet_gemm", 10_000 * scale, 1_000),
                               ("ncclDevKernel_AllGather_RING_LL", 2_000 * scale, 0),
                               ("triton_poi_fused_where_7", 3_000 * scale, 0),
                               (f"triton_red_fused_sum_{scale}", 1_000, 0),
                               ("multi_tensor_apply_kernel", 5_000, 4_000)):
            corr += 1
            t += gap
            events.append({"name": "cudaLaunchKernel", "cat": "cuda_runtime", "ts": t - 1,
                           "dur": 1, "args": {"correlation": corr}})
            events.append({"name": name, "cat": "kernel", "ts": t, "dur": dur,
                           "args": {"correlation": corr}})
            # the all-gather on its own stream, overlapping the next kernel
            t += 0 if name.startswith("nccl") else dur
        path.write_text(json.dumps({"traceEvents": events}))
        return str(path)

    small, large = step(tmp_path / "8k.json", 1), step(tmp_path / "16k.json", 2)
    text = trace.fixed_part(small, large)
    rows = {line.split("  ")[-1].strip(): [float(v) for v in line.split()[:4]]
            for line in text.splitlines()[2:] if line.strip()[:1].isdigit()}
    # compute: gemm 10/20, where 3/6, sum 1/1, AdamW 5/5 (the tail's 50 ms left out)
    assert rows["compute busy"] == [19.0, 32.0, 6.0, 13.0]
    # span: from the first own kernel (after the tail's 1 ms gap): compute 19 + the 4 ms gap
    # before AdamW = 23 (small), 36 (large)
    assert rows["GPU span of the step's own kernels"] == [23.0, 36.0, 10.0, 13.0]
    assert rows["idle (span - compute busy)"] == [4.0, 4.0, 4.0, 0.0]
    assert rows["kind [matmul]"] == [10.0, 20.0, 0.0, 10.0]
    assert rows["kind [communication]"] == [2.0, 4.0, 0.0, 2.0]
    assert rows["kind [other]"] == [9.0, 12.0, 6.0, 3.0]
    assert rows["multi_tensor_apply_kernel"] == [5.0, 5.0, 5.0, 0.0]
    # a compiled kernel named differently at the two shapes shows in one trace only
    assert rows["triton_red_fused_sum_1"] == [1.0, 0.0, 2.0, -1.0]
    assert rows["triton_red_fused_sum_2"] == [0.0, 1.0, -1.0, 1.0]
    out = subprocess.run([sys.executable, "scripts/summarize_trace.py", "--fixed-part", small,
                          large], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and "fixed part (2 x small - large)" in out.stdout, out.stderr


def test_gather_dispatch_benchmark_compares_both_implementations():
    """``bench_gather_dispatch.py --smoke``: one rank's local work at EP2, EP4 and EP8 with the
    row maps over the used rows and over every row, the same results, fewer rows used than the
    buffer holds."""
    bench = _script("bench_gather_dispatch")
    rows = bench.main(["--smoke", "--iters", "1", "--warmup", "0"])
    assert [r["degree"] for r in rows] == [2, 4, 8]
    for r in rows:
        assert r["buffer"] == r["degree"] * 16 * 2 and 0 < r["used"] < r["buffer"]
        assert r["max rel diff"] < 1e-6
        assert r["used fwd+bwd"] > 0 and r["every fwd+bwd"] > 0
    # degree 1: every row used, and the MoE layer's local dispatch timed beside them
    (one,) = bench.main(["--smoke", "--iters", "1", "--warmup", "0", "--degree", "1"])
    assert one["used"] == one["buffer"] == 16 * 2
    assert one["local fwd+bwd"] > 0 and one["local max rel diff"] < 1e-6
    if not torch.cuda.is_available():
        _refuses_without_a_gpu("bench_gather_dispatch")


def test_loss_chunk_benchmark_times_both_forms_against_the_eager_kernel():
    """``bench_loss_chunk.py --smoke``: one chunk of the head's loss, the eager form compiled
    then copied into the group's buffer and the fusable form compiled writing it, each with
    the eager kernel's gradient (the buffer starts as NaN) and loss."""
    bench = _script("bench_loss_chunk")
    before, now = bench.main(["--smoke", "--iters", "1", "--warmup", "0"])
    for r in (before, now):
        assert r["ms"] > 0 and r["kernels"] > 0
        assert r["grad diff"] < 1e-2 and r["loss rel diff"] < 1e-5
    if not torch.cuda.is_available():
        _refuses_without_a_gpu("bench_loss_chunk")


def test_memory_summary_finds_the_peak_and_what_was_live_at_it(tmp_path):
    mem = _script("summarize_memory")
    gib = 1024**3

    def frames(*where):  # innermost first, as a snapshot stores a stack
        return [{"filename": f, "line": line, "name": name} for f, line, name in where]

    block = frames(("/tmp/torchinductor_root/ab/" + "c" * 52 + ".py", 40, "call"),
                   ("/x/torch/_dynamo/eval_frame.py", 9, "_fn"),
                   ("/repo/torchtitan_omni/foundations/qwen3_moe.py", 82, "forward"),
                   ("/repo/torchtitan_omni/train.py", 300, "forward_backward_step"))
    head = frames(("/x/torch/functional.py", 5, "empty"),
                  ("/repo/torchtitan_omni/modules/linear_cross_entropy.py", 115, "chunk"),
                  ("/repo/torchtitan_omni/train.py", 300, "forward_backward_step"))
    trace = [
        {"action": "free_completed", "addr": 1, "size": 1 * gib},  # allocated before the window
        {"action": "alloc", "addr": 10, "size": 2 * gib, "frames": block},
        {"action": "alloc", "addr": 11, "size": 3 * gib, "frames": head},
        {"action": "free_requested", "addr": 11, "size": 3 * gib},  # still held until completed
        {"action": "alloc", "addr": 12, "size": 1 * gib, "frames": block},  # the peak: 2+3+1
        {"action": "free_completed", "addr": 11, "size": 3 * gib},
        {"action": "alloc", "addr": 13, "size": 2 * gib, "frames": head},  # 2+1+2 < the peak
        {"action": "free_completed", "addr": 10, "size": 2 * gib},
    ]
    # now: 4 GiB from before the window (5 when it opened, 1 freed in it) and blocks 12 and 13
    segments = [{"device": 1, "total_size": 12 * gib, "blocks": [
        {"size": 4 * gib, "state": "active_allocated"},
        {"size": 1 * gib, "state": "active_allocated"},
        {"size": 2 * gib, "state": "active_pending_free"},
        {"size": 5 * gib, "state": "inactive"}]}]
    snapshot = {"segments": segments, "device_traces": [[], trace]}
    peak = mem.summarize(snapshot)  # the one device with a trace
    assert (peak.device, peak.index) == (1, 4)
    assert peak.active_now_bytes == 7 * gib and peak.reserved_now_bytes == 12 * gib
    # 5 GiB before the window (7 active now less the window's net 2), 1 of them freed before
    # the peak, and 6 GiB allocated in the window and live at it
    assert peak.peak_bytes == 10 * gib and peak.before_window_bytes == 4 * gib
    # each block by its innermost repository frame and its innermost Python frame
    assert peak.by_site == {
        "torchtitan_omni/foundations/qwen3_moe.py:82 forward <- " + "c" * 52 + ".py:40 call":
            [3 * gib, 2],
        "torchtitan_omni/modules/linear_cross_entropy.py:115 chunk <- functional.py:5 empty":
            [3 * gib, 1]}
    by_repo = mem.summarize(snapshot, device=1, by="repo").by_site
    assert by_repo == {"torchtitan_omni/foundations/qwen3_moe.py:82 forward": [3 * gib, 2],
                       "torchtitan_omni/modules/linear_cross_entropy.py:115 chunk": [3 * gib, 1]}
    text = mem.report(peak, top=1).splitlines()
    assert text[1] == "peak of active memory in the window: 10.00 GiB at entry 4 of 8"
    assert text[2].split()[:2] == ["4.000", "GiB"] and text[-1].endswith("(1 more sites)")
    with pytest.raises(ValueError, match="no trace for device 3"):
        mem.summarize(snapshot, device=3)
    with pytest.raises(ValueError, match="2 devices have a trace"):
        mem.summarize({"segments": [], "device_traces": [trace, trace]})
