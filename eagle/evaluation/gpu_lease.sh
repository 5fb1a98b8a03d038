#!/usr/bin/env bash
# One GPU lease's measurements, run on the device machine from the repository root with OUT set (the device tool's
# output folder); each stage is bounded so that the whole fits a 10-minute call. Results come back as
# $OUT/env.log, $OUT/stages.log (every stage's output) and $OUT/{smollm2,llama,hf}/gpu_costs.json.
# transformers' tested minor travels as a wheel in .whl/ (the image's is older; requirements.txt), fetched here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl transformers==5.23.0
# and named in the call's carry: run(command="bash eagle/evaluation/gpu_lease.sh", carry=[".whl"]).
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

stage() {  # stage NAME SECONDS COMMAND...: the command's output appended to $OUT/stages.log, killed after SECONDS
  local name=$1 seconds=$2; shift 2
  echo "=== $name (limit ${seconds}s) $(date +%T)" | tee -a "$OUT/stages.log"
  timeout "$seconds" "$@" >"/tmp/$name.log" 2>&1
  echo "=== $name: exit $? $(date +%T)"; cat "/tmp/$name.log" >>"$OUT/stages.log"; tail -n 12 "/tmp/$name.log"
}

stage smollm2 120 python3 -m eagle.evaluation.gpu_costs --bases smollm2-135m --out "$OUT/smollm2"
stage llama 150 python3 -m eagle.evaluation.gpu_costs --bases llama-3.2-1b,llama-3.1-8b --direct --out "$OUT/llama"
stage batch_generate 90 bash -c 'for b in 256 512 1024; do python3 -m eagle.train.batch_generate --config smollm2 \
  --batch $b --prompt-len 128 --new-tokens 512 --dtype bfloat16; done'
# HF generate with a static cache compiles its forward for about a minute first
stage hf_compiled 120 python3 -m eagle.evaluation.gpu_costs --bases smollm2-135m --stages hf_generate_static_compiled \
  --hf-compile smollm2-135m --out "$OUT/hf"
stage pytest_gpu 90 python3 -m pytest -m gpu tests/test_gpu.py tests/test_cuda_graphs.py tests/test_batch_generate.py -q -p no:cacheprovider
