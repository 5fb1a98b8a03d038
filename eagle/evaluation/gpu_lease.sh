#!/usr/bin/env bash
# One GPU lease's measurements, run on the device machine from the repository root with OUT set (the device tool's
# output folder); each stage is bounded so that the whole fits a 10-minute call. Results come back as
# $OUT/env.log, $OUT/stages.log (every stage's output) and $OUT/{smollm2,llama,hf}/gpu_costs.json: the graphed round
# (cuda_round.py) beside the forwards' graphs alone, per tree, the GPU tests, HF's compiled static-cache generate.
# transformers' tested minor travels as a wheel in .whl/ (the image's is older; requirements.txt), fetched here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl transformers==5.23.0
# and named in the call's carry: run(command="bash eagle/evaluation/gpu_lease.sh [costs|inductor]", carry=[".whl"]).
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

COSTS="python3 -m eagle.evaluation.gpu_costs --direct --rows 1,8,16,32,64 --contexts 256,1024"
ROUND=graphs,vanilla,eagle_random_acceptance,eagle_forward_graphs,round_trees,runtime_calls_per_round
ROUND=$ROUND,runtime_calls_per_round_forward_graphs,pass_ms
if [ "${1:-costs}" = costs ]; then  # call 1, about 5 minutes
  stage smollm2 150 $COSTS --bases smollm2-135m --stages hf_generate,$ROUND --out "$OUT/smollm2"
  stage pytest_gpu 150 python3 -m pytest -m gpu tests/test_cuda_round.py tests/test_gpu.py tests/test_cuda_graphs.py \
    -q -p no:cacheprovider
  stage llama 150 $COSTS --bases llama-3.1-8b --stages $ROUND --out "$OUT/llama"
  # HF generate with a static cache compiles its forward for about a minute first
  stage hf_compiled 120 python3 -m eagle.evaluation.gpu_costs --bases smollm2-135m --stages hf_generate_static_compiled \
    --hf-compile smollm2-135m --out "$OUT/hf"
else  # `bash eagle/evaluation/gpu_lease.sh inductor`, call 2, about 4 minutes: eager against inductor's kernels
  stage smollm2_inductor 230 python3 -m eagle.evaluation.gpu_costs --bases smollm2-135m --stages inductor_round \
    --out "$OUT/smollm2"
  stage llama_inductor 170 python3 -m eagle.evaluation.gpu_costs --bases llama-3.1-8b --stages inductor_round \
    --out "$OUT/llama"
fi
