#!/usr/bin/env bash
# Sample training rank 0 with py-spy once it is in steady state, from beside a running job:
#
#   NGPU=4 CONFIG_FILE=... ./run_train.sh ... &
#   bash scripts/pyspy_rank0.sh OUT_DIR [WAIT_S=45] [DURATION_S=12]
#
# Finds rank 0 (torchrun's direct child whose environment holds LOCAL_RANK=0: the data loader's
# workers are forked from rank 0 and share its command line and environment, so those alone
# do not tell it apart), waits WAIT_S seconds, then records DURATION_S seconds of Python stacks
# of every thread at 100 Hz (OUT_DIR/pyspy_py.txt) and DURATION_S seconds with native frames at
# 40 Hz (OUT_DIR/pyspy_native.txt), py-spy's raw (collapsed) format, which
# scripts/summarize_pyspy.py reads. PY_SPY names the py-spy binary (default: py-spy on PATH; on
# the offline GPU hosts from its wheel: bash ../shared/gpu-host/wheels.sh py-spy here, then
# PATH=/tmp/site/bin:$PATH there). A compiled EP2 point's rank 0 is still compiling 80-90 s
# after it starts (fortieth session: sampled at 80 s, 40% of the samples were inductor's compile
# workers, which scripts/summarize_pyspy.py flags): give WAIT_S 120 and the point 400 steps or
# more (--training.steps; about 0.19 s a step at EP2 8K) to sample steady state. Better, since
# the compile's length depends on inductor's cache (a warm machine's rank finished 400 steps
# before 120 s, forty-first session): TRAIN_LOG=<the job's log> AFTER_STEP=<N> waits until
# that log shows step N (WAIT_S is then ignored), e.g.
#
#   NGPU=2 CONFIG_FILE=... ./run_train.sh ... --training.steps 250 > /tmp/train.log 2>&1 &
#   TRAIN_LOG=/tmp/train.log AFTER_STEP=60 bash scripts/pyspy_rank0.sh /tmp/spy 0 10; wait
#
# (stop such a job with `wait`, not `pkill -f <its arguments>`: the device tool's own shell
# carries the same words on its command line, and killed itself that way once).
set -uo pipefail
out=${1:?usage: pyspy_rank0.sh OUT_DIR [WAIT_S] [DURATION_S]}
wait_s=${2:-45}
duration=${3:-12}
spy=${PY_SPY:-py-spy}
mkdir -p "$out"
rank0=""
for _ in $(seq 1 300); do  # up to 5 minutes for the job to start its ranks
  for proc in /proc/[0-9]*; do
    # (processes come and go while this looks: the redirections' errors are dropped too)
    { tr '\0' '\n' < "$proc/environ"; } 2>/dev/null | grep -qx LOCAL_RANK=0 || continue
    parent=$({ awk '/^PPid:/ {print $2}' "$proc/status"; } 2>/dev/null)
    { tr '\0' ' ' < "/proc/$parent/cmdline"; } 2>/dev/null | grep -q torchrun || continue
    rank0=${proc#/proc/}
    break
  done
  [ -n "$rank0" ] && break
  sleep 1
done
if [ -z "$rank0" ]; then
  echo "pyspy_rank0: no rank 0 (a child of torchrun with LOCAL_RANK=0) appeared" >&2
  exit 1
fi
echo "pyspy_rank0: rank 0 is pid $rank0: $(tr '\0' ' ' < "/proc/$rank0/cmdline" | head -c 200)"
if [ -n "${TRAIN_LOG:-}" ]; then
  step=${AFTER_STEP:?AFTER_STEP: the step to wait for in TRAIN_LOG}
  # the step lines carry colour codes around "step: N"
  for _ in $(seq 1 900); do
    grep -qE "step: *$step " "$TRAIN_LOG" 2>/dev/null && break
    kill -0 "$rank0" 2>/dev/null || break
    sleep 1
  done
  if ! grep -qE "step: *$step " "$TRAIN_LOG" 2>/dev/null; then
    echo "pyspy_rank0: $TRAIN_LOG never showed step $step (rank 0 gone, or 15 minutes passed)" >&2
    exit 1
  fi
else
  sleep "$wait_s"
fi
# the Python sample without pausing the process (--nonblocking): in the forty-second session,
# rank 0's steps ran 1.17x longer under the blocking Python sample (231 against 198 ms) and
# 2.3x longer under the native one
"$spy" record -p "$rank0" -d "$duration" -r 100 --nonblocking --threads -f raw \
  -o "$out/pyspy_py.txt"
# native frames need the process paused while sampled (py-spy's default, blocking mode)
"$spy" record -p "$rank0" -d "$duration" -r 40 --native --threads -f raw \
  -o "$out/pyspy_native.txt"
