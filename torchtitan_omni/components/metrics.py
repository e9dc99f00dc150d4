"""Training metrics: every named loss, real-token throughput, per-batch MFU and step time.

``OmniMetricsProcessor`` extends TorchTitan's processor: the console line and TensorBoard get
each loss (text, gen_image, moe_aux, ...) next to the total (and MoE load and drops,
``torchtitan_omni.components.moe_metrics``); throughput counts real
(non-padding) tokens; MFU uses the FLOPs of the batches actually trained (attention by
document lengths) when the trainer reports them; the step time is the line's window (since
the previous line, on the GPU's clock where :class:`LogWindow` has marks) over the steps in it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from torchtitan_omni.components.moe_metrics import console_summary


#: metric name of the graphs torch.compile has made so far, summed over the ranks (logged when
#: the job compiles: it grows whenever any rank compiles, and one rank's compile stalls every
#: rank at the next collective)
COMPILED_GRAPHS = "compile/graphs"


@dataclass
class LogWindow:
    """What a log line's throughput covers: the tokens, model FLOPs, data-loading times and
    training steps since the previous line, and the host times it starts and ends at; on a
    GPU also the timed events recorded behind the previous log step's and this one's work
    (``start_mark``, ``end_mark``), whose interval is the window's length when both exist."""

    ntokens: int
    flops: float
    start: float
    end: float
    data_loading_times: list[float] = field(default_factory=list)
    steps: int = 1
    start_mark: Any = None
    end_mark: Any = None

    def seconds(self) -> float:
        """The window's length: on the GPU's clock between the two marks when it has both (the
        host queues a step ahead of the GPU by a varying amount), else on the host's."""
        if self.start_mark is None or self.end_mark is None:
            return self.end - self.start
        self.end_mark.synchronize()
        return self.start_mark.elapsed_time(self.end_mark) / 1e3


class OmniMetricsProcessor(MetricsProcessor):
    """TorchTitan's metrics processor with named losses and per-batch FLOPs."""

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims, tag: str | None = None):
        super().__init__(job_config, parallel_dims, tag)
        self.flops_since_last_log = 0.0
        self.last_metrics: dict[str, Any] = {}
        self._last_mark: Any = None
        #: training steps since the last line (the trainer counts them; a window's divisor)
        self.steps_since_last_log = 0

    def close_window(self, mark: Any = None) -> LogWindow:
        """The counters since the last line, ending now; the next window starts here.
        ``mark``: a timed CUDA event recorded behind this step's work (``DeferredRead.mark``),
        so that the window is measured on the GPU's clock from the previous window's mark."""
        now = time.perf_counter()
        window = LogWindow(self.ntokens_since_last_log, self.flops_since_last_log,
                           self.time_last_log, now, list(self.data_loading_times),
                           steps=self.steps_since_last_log,
                           start_mark=self._last_mark, end_mark=mark)
        self.ntokens_since_last_log = 0
        self.flops_since_last_log = 0.0
        self.steps_since_last_log = 0
        self.data_loading_times.clear()
        self.time_last_log = now
        self._last_mark = mark
        return window

    def log_losses(
        self,
        step: int,
        total_loss: float,
        max_loss: float,
        losses: dict[str, float],
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
        window: LogWindow | None = None,
    ) -> None:
        """Log one step: the total and every named loss, throughput, MFU and memory.
        ``window``: what the throughput covers (:meth:`close_window`), when it was closed
        before this call (a deferred line); else the window up to now."""
        if window is None:
            window = self.close_window()
        time_delta = window.seconds()
        step_seconds = time_delta / max(1, window.steps)
        tps = window.ntokens / (time_delta * self.parallel_dims.non_data_parallel_size)
        if window.flops > 0:
            flops_per_s = window.flops / time_delta
        else:
            flops_per_s = self.num_flops_per_token * tps
        mfu = 100 * flops_per_s / self.gpu_peak_flops
        mem = self.device_memory_monitor.get_peak_stats()
        metrics: dict[str, Any] = {
            "loss_metrics/global_avg_loss": total_loss,
            "loss_metrics/global_max_loss": max_loss,
            "grad_norm": grad_norm,
            "throughput(tps)": tps,
            "tflops": flops_per_s / 1e12,
            "mfu(%)": mfu,
            "time_metrics/end_to_end(s)": step_seconds,
            "memory/max_reserved(GiB)": mem.max_reserved_gib,
            "memory/max_reserved(%)": mem.max_reserved_pct,
            # what tensors held at the peak: reserved less the caching allocator's slack
            "memory/max_active(GiB)": mem.max_active_gib,
        }
        if window.data_loading_times:
            metrics["time_metrics/data_loading(s)"] = sum(window.data_loading_times) / len(
                window.data_loading_times
            )
        for name, value in losses.items():
            metrics[f"loss_metrics/{name}"] = value
        metrics.update(extra_metrics or {})
        self.logger.log(metrics, step)
        self.last_metrics = metrics

        c = self.color
        # "+ 0.0" prints a loss without targets this step (0 x something) as 0, not -0
        named = "  ".join(f"{name}: {value + 0.0:.5f}" for name, value in losses.items())
        logger.info(
            f"{c.red}step: {step:2}  {c.green}loss: {total_loss:8.5f} ({named})  "
            f"{c.orange}grad_norm: {grad_norm:7.4f}  "
            f"{c.turquoise}memory: {mem.max_reserved_gib:5.2f}GiB({mem.max_reserved_pct:.2f}%) "
            f"active: {mem.max_active_gib:5.2f}GiB  "
            f"{c.blue}tps: {round(tps):,}  {c.cyan}tflops: {flops_per_s / 1e12:,.2f}  "
            f"{c.magenta}mfu: {mfu:.2f}%{c.reset}  step time: {step_seconds:.3f}s"
            + (
                f"  compiled graphs: {metrics[COMPILED_GRAPHS]}"
                if COMPILED_GRAPHS in metrics
                else ""
            )
            + (f"  {moe}" if (moe := console_summary(metrics)) else "")
        )
        self.device_memory_monitor.reset_peak_stats()


def build_omni_metrics_processor(
    job_config: JobConfig, parallel_dims: ParallelDims, model_args=None, tag: str | None = None
) -> OmniMetricsProcessor:
    """``TrainSpec.build_metrics_processor_fn``."""
    del model_args
    return OmniMetricsProcessor(job_config, parallel_dims, tag)
