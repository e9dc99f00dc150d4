#!/usr/bin/env bash
# GPU call 1 (not committed): attention kernels, GPU tests of the fast paths, compile on CUDA.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, torchao; print(torch.__version__, torchao.__version__)" 2>&1 | tail -1
(timeout 200 python3 scripts/bench_attention.py --out $OUT/attention.json > $OUT/attention.md 2>&1; echo "attention rc=$?" >> $OUT/attention.md) &
ATT=$!
python3 scripts/build_default_dataset.py > $OUT/build.log 2>&1 || { tail $OUT/build.log; }
python3 scripts/build_long_context_dataset.py --config train_configs/llama_omni_8B.toml --seq-len 8192 --rows 16 --out data/lc8k >> $OUT/build.log 2>&1 || tail -3 $OUT/build.log
wait $ATT
timeout 150 python3 -m pytest tests/test_gpu_fast_paths.py tests/encoders/test_gpu.py tests/foundations/test_moe_gpu.py -q -x > $OUT/gputests.log 2>&1; tail -5 $OUT/gputests.log
run() { tag=$1; shift; NGPU=1 CONFIG_FILE=train_configs/llama_omni_8B.toml timeout 170 ./run_train.sh --training.dataset long_context --training.dataset_path data/lc8k --job.dump_folder /tmp/o_$tag --checkpoint.no-enable --metrics.no-enable_tensorboard --training.seq_len 8192 --training.steps 10 --metrics.log_freq 1 --omni.llm_layers 8 --data.modalities image,video "$@" > $OUT/run_$tag.log 2>&1; echo "$tag rc=$?"; grep -a "step:" $OUT/run_$tag.log | sed 's/\x1b\[[0-9;]*m//g' | tail -4 | cut -c1-230; grep -a "Error\|error:" $OUT/run_$tag.log | head -5 | cut -c1-300; }
run eager
run compiled --compile.enable --compile.components model,loss
run compiled_f8 --compile.enable --compile.components model,loss --model.converters float8
cat $OUT/attention.md | tail -45
