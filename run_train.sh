#!/usr/bin/bash
# Train an omni model, TorchTitan-style:
#   NGPU=2 CONFIG_FILE=train_configs/llama_omni_debug.toml ./run_train.sh --training.steps 20
# Environment: NGPU (processes; default 1), CONFIG_FILE (default: the bundled debug omni
# config), LOG_RANK (ranks whose output is shown; default 0), LOG_DIR (also write every rank's
# whole output to files under this folder; default: none), TRAIN_FILE (entry module;
# default torchtitan_omni.train), TORCHTITAN_OMNI_DEVICE (auto|cuda|cpu; default auto: CUDA
# when a GPU is visible, else CPU with gloo), CUDA_SCALE_LAUNCH_QUEUES (the CUDA driver's launch
# queue size; default 4x, below), TORCHTITAN_OMNI_PRECHECK (0: no config check before torchrun;
# default 1). Extra --section.key value arguments pass through.
set -eo pipefail

for arg in "$@"; do
  if [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then
    cat <<'USAGE'
Usage: [VARIABLE=value ...] ./run_train.sh [--section.key value ...]
Launcher variables:
  NGPU                    processes (GPUs, or CPU processes without a GPU); default 1
  CONFIG_FILE             TOML config; default ./train_configs/llama_omni_debug.toml
  LOG_RANK                ranks whose output is shown; default 0
  LOG_DIR                 also write every rank's whole output to files under this folder
                          (torchrun's --log-dir: <LOG_DIR>/<run id>/attempt_0/<rank>/); default none
  TRAIN_FILE              entry module; default torchtitan_omni.train
  TORCHTITAN_OMNI_DEVICE  auto | cuda | cpu; default auto (CUDA when a GPU is visible)
  CUDA_SCALE_LAUNCH_QUEUES  the CUDA driver's kernel launch queue size, a multiple such as
                          2x; default 4x (the host can run further ahead of the GPU)
  TORCHTITAN_OMNI_PRECHECK  0 skips the config check before torchrun (the ranks still
                          check it); default 1
Outputs go under job.dump_folder: the log on the console, TensorBoard events in
<dump_folder>/<metrics.save_tb_folder>, checkpoints in <dump_folder>/<checkpoint.folder>.
Every key of the config (with its value under CONFIG_FILE) follows.

USAGE
    exec python3 -m torchtitan_omni.config.check \
      --job.config_file "${CONFIG_FILE:-./train_configs/llama_omni_debug.toml}" "$@"
  fi
done

NGPU=${NGPU:-1}
LOG_RANK=${LOG_RANK:-0}
CONFIG_FILE=${CONFIG_FILE:-"./train_configs/llama_omni_debug.toml"}
TRAIN_FILE=${TRAIN_FILE:-"torchtitan_omni.train"}
export TORCHTITAN_OMNI_DEVICE=${TORCHTITAN_OMNI_DEVICE:-auto}

if [ "$TORCHTITAN_OMNI_DEVICE" = "cpu" ] || { [ "$TORCHTITAN_OMNI_DEVICE" = "auto" ] && \
    ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; }; then
  # One process per "GPU" on CPU: keep them from fighting over the cores.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi

# Check the config (keys, types, degrees vs. NGPU) once, with a one-line error, before
# starting NGPU processes. TORCHTITAN_OMNI_PRECHECK=0 skips this process (it imports TorchTitan:
# seconds of start-up); every rank runs the same check, so a bad config still stops the job,
# its line then shown by the ranks and torchrun's failure summary.
case "${TORCHTITAN_OMNI_PRECHECK:-1}" in
  0|1) ;;
  *) echo "run_train.sh: TORCHTITAN_OMNI_PRECHECK=${TORCHTITAN_OMNI_PRECHECK} is not 0 or 1" >&2
     exit 2 ;;
esac
if [ "${TORCHTITAN_OMNI_PRECHECK:-1}" = "1" ]; then
  WORLD_SIZE=$NGPU python3 -m torchtitan_omni.config.check --job.config_file "${CONFIG_FILE}" "$@"
fi

LOG_DIR_ARGS=()
if [ -n "${LOG_DIR:-}" ]; then
  LOG_DIR_ARGS=(--log-dir "${LOG_DIR}")
fi

# CUDA_SCALE_LAUNCH_QUEUES=4x: the driver queues up to ~4,100 kernel launches on a stream
# instead of ~1,000 before a launch blocks the host (measured on H100, driver 580). The LLM's
# backward fills the default queue, so the host could not get ahead of the GPU by more than
# ~1,000 launches; the encoders' small kernels after it (their backward, the optimizer, the
# next step's encoder forward) then ran at the host's launch pace with the GPU idle
# (docs/performance.md, "Launch queues"). A value of your own is kept (the CUDA programming
# guide's environment variables list the variable).
PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-"expandable_segments:True"} \
CUDA_SCALE_LAUNCH_QUEUES=${CUDA_SCALE_LAUNCH_QUEUES:-4x} \
torchrun --nproc_per_node="${NGPU}" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
  --local-ranks-filter "${LOG_RANK}" --role rank --tee 3 "${LOG_DIR_ARGS[@]}" \
  -m "${TRAIN_FILE}" --job.config_file "${CONFIG_FILE}" "$@"
