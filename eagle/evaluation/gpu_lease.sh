#!/usr/bin/env bash
# One GPU lease's measurements, run on the device machine from the repository root with OUT set (the device tool's
# output folder); each stage is bounded so that the whole fits about 7 minutes. Results come back as
# $OUT/env.log, $OUT/{smollm2,llama}/gpu_costs.json and a log per stage.
#   transformers' tested minor travels as a wheel in .whl/ (the image's is older): see requirements.txt
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv
  nproc; lscpu | grep -E 'Model name'
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.log"

stage() {  # stage NAME SECONDS COMMAND...: the command's output in $OUT/NAME.log, killed after SECONDS
  local name=$1 seconds=$2; shift 2
  echo "=== $name (limit ${seconds}s) $(date +%T)"
  timeout "$seconds" "$@" >"$OUT/$name.log" 2>&1
  echo "=== $name: exit $? $(date +%T)"; tail -n 12 "$OUT/$name.log"
}

stage smollm2 150 python3 -m eagle.evaluation.gpu_costs --bases smollm2-135m --hf-compile smollm2-135m --out "$OUT/smollm2"
if [ -f eagle/train/batch_generate.py ]; then
  stage batch_generate 90 bash -c 'for b in 256 512 1024; do python3 -m eagle.train.batch_generate --config smollm2 \
    --batch $b --prompt-len 128 --new-tokens 512 --dtype bfloat16; done'
fi
stage llama 150 python3 -m eagle.evaluation.gpu_costs --bases llama-3.2-1b,llama-3.1-8b --out "$OUT/llama"
stage pytest_gpu 90 python3 -m pytest -m gpu tests/test_gpu.py tests/test_cuda_graphs.py tests/test_batch_generate.py -q -p no:cacheprovider
