"""The benchmark scripts' own logic: reading training logs and profiler traces."""

import json

from tests.harness import load_script as _script


OMNI_LINE = (
    "[rank0]:[titan] 2026-11-22 18:07:05,202 - root - INFO - \x1b[31mstep: 11  \x1b[32mloss:  7.39948 "
    "(text: 7.39948  gen_image: 0.00000)  \x1b[38;2;180;60;0mgrad_norm:  4.2762  \x1b[38;2;54;234;195m"
    "memory: 74.12GiB(53.01%)  \x1b[34mtps: 4,424  \x1b[36mtflops: 226.62  \x1b[35mmfu: 22.91%\x1b[39m"
)
STOCK_LINE = (
    "[rank0]:[titan] 2026-11-22 18:06:10,000 - root - INFO - step: 12  loss:  7.21135  "
    "grad_norm: 16.0736  memory: 63.74GiB(45.59%)  tps: 8,507  tflops: 492.69  mfu: 49.82%"
)


def test_step_lines_of_omni_and_stock_logs():
    bench = _script("bench_scaling")
    steps = bench.parse_steps("\n".join(["noise", OMNI_LINE, STOCK_LINE]))
    assert steps == [
        {"step": 11, "mem_gib": 74.12, "tps": 4424.0, "tflops": 226.62, "mfu": 22.91},
        {"step": 12, "mem_gib": 63.74, "tps": 8507.0, "tflops": 492.69, "mfu": 49.82},
    ]
    point = bench.Point("p", "8B", 4, 8192, stock=True, warmup=11)
    row = bench.summarize(point, steps[:1] + steps[1:], 10.0, 0)
    assert row["tps"] == 8507.0 and row["mem_gib"] == 74.12  # median after warm-up, peak overall
    assert "-m torchtitan.train" in row["command"] and "--training.seq_len 8192" in row["command"]


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
    assert "moe_30B-A3B_12L_8k_ep4_cap1.25_compile" in names


def test_trace_summary_counts_busy_time_and_gaps(tmp_path):
    trace = _script("summarize_trace")
    events = [
        {"name": "ProfilerStep#5", "cat": "user_annotation", "ts": 0, "dur": 40000},
        {"name": "aten::_local_scalar_dense", "cat": "cpu_op", "ts": 11000, "dur": 9000},
        {"name": "nvjet_sm90_tst_256x128", "cat": "kernel", "ts": 10000, "dur": 1000},
        {"name": "nvjet_sm90_tst_256x128", "cat": "kernel", "ts": 10500, "dur": 1000},  # overlaps
        {"name": "flash_fwd_kernel", "cat": "kernel", "ts": 21500, "dur": 500},
        {"name": "ncclDevKernel_AllGather_RING_LL", "cat": "kernel", "ts": 12000, "dur": 9000},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    text = trace.summarize(str(path))
    # window 10.0-22.0 ms; compute busy 1.5 + 0.5 ms; one 10 ms gap opened by the sync
    assert "GPU window 12.0 ms, compute kernels busy 2.0 ms (17%)" in text
    assert "communication kernels 9.0 ms" in text
    assert "gaps >= 2 ms: 10.0 ms (1 gaps)" in text
    assert "10.0 ms  aten::_local_scalar_dense" in text
