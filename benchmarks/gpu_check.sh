#!/usr/bin/env bash
# Every GPU check of vitkit in one command, for a machine that is lent a GPU for a few minutes: the machine;
# the speed of ViT-B/16 inference and training against timm (benchmarks/bench_gpu.py; the training step also
# compiled with CUDA graphs); the trainer end to end on the GPU (the `demo` recipe on Fashion-MNIST, then
# `vitkit eval`); and the test suite with CUDA present (its CUDA tests run instead of being skipped; "auto"
# devices become the GPU).
#
#   bash benchmarks/gpu_check.sh                               # on the GPU machine; results in $OUT or runs/gpu-check
#   PY=.venv/bin/python QUICK=1 bash benchmarks/gpu_check.sh   # the same steps on the CPU, tiny and short
#
# Each step has its own time limit and appends its output to $OUT/log.txt as it goes, so what finished comes
# back even when a later step runs out of time; a failing step does not stop the next. The measurements are
# named as records (benchmarks/results/README.md: gpu-infer_<gpu>_<date>.json, gpu-train_..._run1.json,
# gpu-train_..._cudagraphs.json, recipe-demo_<gpu>_<date>.json); copy them into benchmarks/results/ to keep
# them. Fashion-MNIST is looked for as vitkit always does ($VITKIT_DATA, the cache, /usr/share/datasets);
# without it the training step is skipped.
# Exit status: the number of steps that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-runs/gpu-check}
QUICK=${QUICK:-0}
mkdir -p "$OUT"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
where=$("$PY" benchmarks/records.py slug "${gpu:-$(uname -m)-cpu}" 2>/dev/null || echo unknown)
day=$(date -u +%Y-%m-%d)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
failed=0

step() {  # step NAME SECONDS COMMAND...: run with a time limit, append to $OUT/log.txt, count failures
    local name=$1 limit=$2 start rc
    shift 2
    echo "== $name (limit ${limit} s): $*"
    start=$(date +%s)
    timeout "$limit" "$@" >"$OUT/step.log" 2>&1
    rc=$?
    { echo "== $name: $*"; cat "$OUT/step.log"; } >>"$OUT/log.txt"
    tail -n 25 "$OUT/step.log"
    rm -f "$OUT/step.log"
    echo "-- $name: exit $rc after $(( $(date +%s) - start )) s"
    [ "$rc" = 0 ] || failed=$((failed + 1))
}

if [ "$QUICK" = 1 ]; then
    bench=(--device cpu --tiny --no-compile --repeats 3 --warmup 1 --batch 8 --train-batch 8)
    train_set=(--set steps=20 --set eval_every=0)
    tests=(tests/test_optimize.py -k "cuda or bf16")
else
    bench=(--repeats 20 --warmup 3 --profile 12)
    train_set=()
    tests=(tests -n 8 -rf --tb=short)  # 8 workers of 2 threads each (OMP_NUM_THREADS below) on 16 cores
fi

step machine 60 bash -c "nvidia-smi -L 2>/dev/null || echo 'no nvidia-smi'; \
    $PY -c 'import sys, torch, timm; print(sys.version.split()[0], \"torch\", torch.__version__, \"timm\", \
timm.__version__, \"cuda\", torch.cuda.is_available() and torch.cuda.get_device_name(0))'"
step bench_inference 180 "$PY" benchmarks/bench_gpu.py "${bench[@]}" --only inference \
    --json "$OUT/gpu-infer_${where}_${day}.json"
step bench_training 200 "$PY" benchmarks/bench_gpu.py "${bench[@]}" --only training \
    --json "$OUT/gpu-train_${where}_${day}_run1.json"
# The eager training step is bound by the host's kernel launches (docs/speed.md): CUDA graphs are the lever.
step bench_training_cudagraphs 200 "$PY" benchmarks/bench_gpu.py "${bench[@]}" --only training \
    --train-compile-mode reduce-overhead --json "$OUT/gpu-train_${where}_${day}_cudagraphs.json"

if "$PY" -c "import sys; from vitkit.data.fashion_mnist import find_fashion_mnist as f; sys.exit(not (f('train') and f('test')))"
then
    run="${TMPDIR:-/tmp}/vitkit-gpu-demo"  # outside $OUT: the device tool brings back 8 files at most
    rm -rf "$run"
    step train_demo 80 "$PY" -m vitkit.cli.main train demo --out "$run" --no-progress "${train_set[@]}"
    step eval_demo 40 "$PY" -m vitkit.cli.main eval "$run/last" --data fashion-mnist --out "$run/eval"
    cp "$run/result.json" "$OUT/recipe-demo_${where}_${day}.json" 2>/dev/null
    cp "$run/metrics.csv" "$OUT/demo_metrics.csv" 2>/dev/null
    cp "$run/eval/metrics.json" "$OUT/demo_eval.json" 2>/dev/null
else
    echo "== train_demo: skipped (no Fashion-MNIST; set VITKIT_DATA to a folder holding fashion-mnist/)"
fi

step tests 150 env OMP_NUM_THREADS=2 "$PY" -m pytest -q -p no:cacheprovider "${tests[@]}"
echo "== $failed step(s) failed"
exit "$failed"
