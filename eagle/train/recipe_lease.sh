#!/usr/bin/env bash
# The GPU recipe (gpu_recipe.py run) over the calls of one warm lease, from the repository root with OUT set:
#   bash eagle/train/recipe_lease.sh start --inputs .gpu/in1 .gpu/in2 ... [run options]
#   bash eagle/train/recipe_lease.sh wait
#   bash eagle/train/recipe_lease.sh fetch N    # results bundles of more than 7 parts: parts 7N.. (next calls)
# `start` installs the wheels carried in .whl/ (transformers, gguf) and starts the recipe in its own process session
# (it outlives the call while the lease stays warm); both then wait up to WAIT seconds (default 560) for it to end and
# copy the results bundle's parts and the recipe's log to $OUT. Work, log and results stay on the device under
# $WORK (default /root/recipe), so a `wait` in the next call (within the lease's idle time) picks up where this one
# stopped.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site
WORK=${WORK:-/root/recipe}
LOG=$WORK.log
mode=${1:?start, wait or fetch}; shift
if [ "$mode" = fetch ]; then  # a call brings back 8 files at most: the manifest and 7 parts, the N-th seven
  cp "$WORK-results/manifest.json" "$OUT/"
  ls "$WORK-results" | grep '^part-' | sort | sed -n "$((7 * ${1:-0} + 1)),$((7 * ${1:-0} + 7))p" |
    while read -r part; do cp "$WORK-results/$part" "$OUT/"; done
  ls "$OUT"; exit 0
fi
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
if grep -q "recipe done" "$LOG"; then
  n=$(ls "$WORK-results" | grep -c '^part-')
  if [ "$n" -le 6 ]; then cp "$WORK-results"/* "$OUT/"; echo "results copied"
  else echo "results: $n parts, more than a call brings back: recipe_lease.sh fetch 0, fetch 1, ..."; fi
fi
