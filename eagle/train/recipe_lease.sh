#!/usr/bin/env bash
# The GPU recipe (gpu_recipe.py run) over the calls of one warm lease, from the repository root with OUT set:
#   bash eagle/train/recipe_lease.sh start --inputs .gpu/in1 .gpu/in2 ... [run options]
#   bash eagle/train/recipe_lease.sh wait
# `start` installs the wheels carried in .whl/ (transformers, gguf) and starts the recipe in its own process session
# (it outlives the call while the lease stays warm); both then wait up to WAIT seconds (default 560) for it to end and
# copy the results bundle's parts and the recipe's log to $OUT. Work, log and results stay on the device under
# $WORK (default /root/recipe), so a `wait` in the next call (within the lease's idle time) picks up where this one
# stopped.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site
WORK=${WORK:-/root/recipe}
LOG=$WORK.log
mode=${1:?start or wait}; shift
if [ "$mode" = start ]; then
  if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
  mkdir -p "$WORK"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$LOG" 2>&1
  setsid nohup python3 -m eagle.train.gpu_recipe run --work "$WORK" --results "$WORK-results" "$@" \
    >>"$LOG" 2>&1 </dev/null &
  sleep 2
fi
deadline=$((SECONDS + ${WAIT:-560}))
while [ $SECONDS -lt $deadline ] && ! grep -q "recipe done" "$LOG" && pgrep -f "gpu_recipe run" >/dev/null; do
  sleep 5
done
tr "\r" "\n" <"$LOG" | grep -v "it/s\]$" | tail -n 40
cp "$LOG" "$OUT/recipe.log"
if grep -q "recipe done" "$LOG"; then cp "$WORK-results"/* "$OUT/"; echo "results copied"; fi
