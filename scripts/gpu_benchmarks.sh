#!/usr/bin/env bash
# Benchmarks for one call on a GPU host without network (docs/performance.md says which plans
# answer which question). From the repository root, with the missing wheels in .whl/
# (bash ../shared/gpu-host/wheels.sh av==18.1.0 espeakng-loader==0.2.4 soundfile==0.14.0
# torchao==0.18.0):
#
#   bash scripts/gpu_benchmarks.sh attention omni_1gpu:no-compile omni_1gpu:compile-only
#
# Each argument is "attention" (scripts/bench_attention.py), "encoder_graphs"
# (scripts/bench_encoder_graphs.py; both on one GPU) or a bench_scaling.py plan, with
# ":no-compile" or ":compile-only" to split a plan over calls, or "=point,point" to run only
# those points (in the plan's order), e.g. moe_4gpu=moe_30B-A3B_12L_8k_ep4_text_exact. Tables go
# to $OUT (or bench_out/), the training logs and the tables' JSON rows into one archive there
# (logs.tar.gz, or logs_2.tar.gz for a second run in the same call; a device call brings back
# at most 8 files), the summaries of profiled steps
# (scripts/summarize_trace.py, every rank's: where one rank idles, another may be the slow one)
# into traces.txt, with the fixed part of a point profiled at 8K and at 16K (the same name
# otherwise: what of its step does not grow with tokens); the tables are printed last.
#
# EXTRA="--profiling.enable_memory_snapshot --profiling.profile_freq 4 --training.steps 5
# --lr_scheduler.warmup_steps 5" snapshots every rank's memory at step 4; memory.txt then holds
# what each held at its peak (scripts/summarize_memory.py), the baseline tree's too.
#
# EXTRA="<arguments>" appends trainer arguments to every point (bench_scaling.py --extra), e.g.
# EXTRA="--profiling.enable_profiling --profiling.profile_freq 20" with a 30-step point profiles
# its step 20 (summarized into traces.txt); KEEP_TRACES=1 brings the raw rank-0 traces back
# too, KEEP_TRACES=all every rank's (gzipped, in traces.tar, dropped if over 16 MiB: about 2 MiB
# a rank for the 8B's realistic step, so profile one or two points then).
#
# INDUCTOR_KNOBS="key=value,..." sets torch._inductor.config for every point (and the baseline
# tree's) through scripts/inductor_knobs/sitecustomize.py, e.g. combo_kernels=True, or (torch
# 2.13) cpp_wrapper=True,no_c_shim=aten._grouped_mm.default: an A/B of inductor's settings without a
# code change (run the script twice in one call, with and without, OUT=$OUT/<name> apart); on
# torch 2.11, which has no C shim of grouped GEMM, cpp_wrapper=True,fallback=aten._grouped_mm.default.
#
# BASELINE_TREE=<folder> runs each argument's points again in an older tree right after this
# tree's (the same call, so the ratio is fair), its tables as baseline_*.md; make it before the
# call, untracked so that it travels: mkdir baseline && git archive <commit> | tar -x -C baseline
set -uo pipefail
out=${OUT:-bench_out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
baseline=${BASELINE_TREE:-}
if [ -n "$baseline" ]; then
  # the older tree reads this one's datasets and tokenizer (both git-ignored, so not archived)
  mkdir -p data assets
  [ -e "$baseline/data" ] || ln -s "$PWD/data" "$baseline/data"
  [ -e "$baseline/assets" ] || ln -s "$PWD/assets" "$baseline/assets"
fi
if ! python3 -c "import torchtitan" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    || { echo "gpu_benchmarks: the carried wheels did not install" >&2; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else  # this tree first (a baseline tree run beside it keeps the installed wheels' path)
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# the datasets' builders need these on a fresh host (a call without them builds nothing and
# times nothing: say so at once)
if ! python3 -c "import soundfile, av, espeakng_loader, torchao" 2>/dev/null; then
  echo "gpu_benchmarks: soundfile, av, espeakng_loader or torchao is missing: run bash" \
    "../shared/gpu-host/wheels.sh av==18.1.0 espeakng-loader==0.2.4 soundfile==0.14.0" \
    "torchao==0.18.0 on the workstation and carry .whl" >&2
  exit 1
fi
if [ -n "${INDUCTOR_KNOBS:-}" ]; then  # checked here: a bad knob stops with its one line
  export PYTHONPATH=$PWD/scripts/inductor_knobs:$PYTHONPATH
  python3 -c pass || exit 1
fi
export PYTHONUNBUFFERED=1
deadline=${DEADLINE:-540}
logs=$(mktemp -d)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$out/device.txt"
[ -n "${INDUCTOR_KNOBS:-}" ] && echo "INDUCTOR_KNOBS=$INDUCTOR_KNOBS" | tee -a "$out/device.txt"
start=$SECONDS
for arg in "$@"; do
  only=""
  case $arg in *=*) only=${arg#*=}; arg=${arg%%=*} ;; esac
  plan=${arg%%:*}
  mode=${arg#*:}
  [ "$mode" = "$arg" ] && mode=""
  left=$((deadline - (SECONDS - start)))
  if [ "$left" -le 30 ]; then
    echo "gpu_benchmarks: no time left for $arg" | tee -a "$out/skipped.txt"
    continue
  fi
  if [ "$plan" = "attention" ]; then
    timeout "$left" python3 scripts/bench_attention.py --out "$out/attention.json" \
      > "$out/attention.md" 2>&1 || echo "attention: exit $?" >> "$out/attention.md"
    continue
  fi
  if [ "$plan" = "encoder_graphs" ]; then
    timeout "$left" python3 scripts/bench_encoder_graphs.py > "$out/encoder_graphs.md" 2>&1 \
      || echo "encoder_graphs: exit $?" >> "$out/encoder_graphs.md"
    continue
  fi
  flags=()
  [ -n "$mode" ] && flags=("--$mode")
  [ -n "$only" ] && flags+=("--only" "$only")
  [ -n "${EXTRA:-}" ] && flags+=("--extra" "$EXTRA")
  name=$plan${mode:+_$mode}${only:+_$(echo "$only" | cksum | cut -c1-6)}
  python3 scripts/bench_scaling.py --plan "$plan" "${flags[@]}" --out "$out/$name.md" \
    --logs "$logs/$name" --deadline "$left" > "$logs/$name.runner.log" 2>&1
  if [ -n "$baseline" ]; then
    left=$((deadline - (SECONDS - start)))
    (cd "$baseline" && PYTHONPATH=$PWD:$PYTHONPATH python3 scripts/bench_scaling.py \
      --plan "$plan" "${flags[@]}" --out "$out/baseline_$name.md" --logs "$logs/baseline_$name" \
      --deadline "$left" > "$logs/baseline_$name.runner.log" 2>&1)
  fi
done
# the JSON rows travel in the archive: a device call brings back at most 8 files
for rows in "$out"/*.json; do [ -f "$rows" ] && mv "$rows" "$logs/"; done
# a second run of this script in the same call keeps the first's archive (logs_2.tar.gz, ...)
archive="$out/logs.tar.gz"
n=2
while [ -e "$archive" ]; do archive="$out/logs_$n.tar.gz"; n=$((n + 1)); done
tar -czf "$archive" -C "$logs" . 2>/dev/null
for trace in outputs/bench_*/profile_traces/*/rank*_trace.json; do  # every rank: their skew
  [ -f "$trace" ] || continue
  python3 scripts/summarize_trace.py --top 15 "$trace" >> "$out/traces.txt"
  if [ "${KEEP_TRACES:-}" = all ] || { [ -n "${KEEP_TRACES:-}" ] && [ "${trace##*/}" = rank0_trace.json ]; }; then
    # the raw traces too (rank 0's, or every rank's), gzipped, one archive (under 16 MiB)
    point=${trace#outputs/bench_}
    mkdir -p "$logs/traces" && gzip -c "$trace" > "$logs/traces/${point%%/*}_${trace##*/}.gz"
  fi
done
# a point profiled at 8K and at 16K (names otherwise equal, same step): what of its step does
# not grow with tokens, per rank (summarize_trace.py --fixed-part), after the summaries
for small in outputs/bench_*_8k_*/profile_traces/*/rank*_trace.json; do
  [ -f "$small" ] || continue
  large=${small/_8k_/_16k_}
  [ -f "$large" ] || continue
  python3 scripts/summarize_trace.py --top 15 --fixed-part "$small" "$large" >> "$out/traces.txt"
done
# memory snapshots (EXTRA="--profiling.enable_memory_snapshot --profiling.profile_freq N"),
# this tree's and the baseline tree's: what each rank held at its peak (summarize_memory.py)
for snap in outputs/bench_*/memory_snapshot/*/rank*_memory_snapshot.pickle \
    ${baseline:+"$baseline"/outputs/bench_*/memory_snapshot/*/rank*_memory_snapshot.pickle}; do
  [ -f "$snap" ] || continue
  { echo "== $snap"; python3 scripts/summarize_memory.py "$snap" --top 25; } >> "$out/memory.txt" 2>&1
done
if [ -d "$logs/traces" ]; then
  tar -cf "$out/traces.tar" -C "$logs/traces" . 2>/dev/null
  size=$(stat -c %s "$out/traces.tar")
  [ "$size" -le 16000000 ] || { rm -f "$out/traces.tar"; echo "gpu_benchmarks: traces.tar ($size bytes) over the 16 MiB a file may bring back" | tee -a "$out/skipped.txt"; }
fi
# this tree's tables first, then the baseline tree's (their names sort first; a header marks
# them, so that a row is never read as the other tree's)
for table in "$out"/*.md; do
  case ${table##*/} in baseline_*) continue ;; esac
  echo "== $table${INDUCTOR_KNOBS:+ (INDUCTOR_KNOBS=$INDUCTOR_KNOBS)}"
  grep -v '^- `' "$table" | head -40
done
for table in "$out"/baseline_*.md; do
  [ -f "$table" ] || continue
  echo "== BASELINE TREE ($baseline): $table${INDUCTOR_KNOBS:+ (INDUCTOR_KNOBS=$INDUCTOR_KNOBS)}"
  grep -v '^- `' "$table" | head -40
done
# each profiled step's headline and timeline by part (the whole summaries are in traces.txt)
if [ -f "$out/traces.txt" ]; then
  echo "== $out/traces.txt (by part, and the fixed parts)"
  awk '/^[^ ]/ {print; show=0} /^  by part/ {show=1} /^fixed part/ {show=1; next} show' "$out/traces.txt"
fi
