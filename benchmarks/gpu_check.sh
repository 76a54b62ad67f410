#!/usr/bin/env bash
# Every GPU check of vitkit in one command, for a machine that is lent a GPU for a few minutes: the machine;
# the speed of ViT-B/16 inference and training against timm (benchmarks/bench_gpu.py; the training step also
# compiled with CUDA graphs); the trainer end to end on the GPU (the `demo` recipe on Fashion-MNIST, then
# `vitkit eval`); the data-scaling study and its ablations with 5 seeds (benchmarks/study_data_scaling.py);
# and the test suite with CUDA present (its CUDA tests run instead of being skipped; "auto" devices become
# the GPU).
#
#   bash benchmarks/gpu_check.sh                               # on the GPU machine; results in $OUT or runs/gpu-check
#   ONLY="study" bash benchmarks/gpu_check.sh                  # only the steps named (machine bench train study tests)
#   ONLY="recipes" bash benchmarks/gpu_check.sh                # Fashion-MNIST's distilled recipes (below; not by default)
#   PY=.venv/bin/python QUICK=1 bash benchmarks/gpu_check.sh   # the same steps on the CPU, tiny and short
#
# Each step has its own time limit and appends its output to $OUT/log.txt as it goes, so what finished comes
# back even when a later step runs out of time; a failing step does not stop the next. The measurements are
# named as records (benchmarks/results/README.md: gpu-infer_<gpu>_<date>.json, gpu-train_..._run1.json,
# gpu-train_..._cudagraphs.json, recipe-demo_<gpu>_<date>.json); copy them into benchmarks/results/ to keep
# them. The study's records (one JSON a cell) come back as one archive, $OUT/study-data-scaling_<gpu>.tar.gz:
# unpack it into benchmarks/results/ beside the CPU's. Fashion-MNIST is looked for as vitkit always does
# ($VITKIT_DATA, the cache, /usr/share/datasets); without it the training and study steps are skipped (a
# machine with no copy of its own can be given one: its four IDX files in runs/data/fashion-mnist/, carried
# with the working tree, and VITKIT_DATA=runs/data).
# Exit status: the number of steps that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-runs/gpu-check}
QUICK=${QUICK:-0}
ONLY=" ${ONLY:-machine bench train study tests} "  # or recipes (not by default)
mkdir -p "$OUT"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
where=$("$PY" benchmarks/records.py slug "${gpu:-$(uname -m)-cpu}" 2>/dev/null || echo unknown)
day=$(date -u +%Y-%m-%d)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
failed=0

wanted() { [[ $ONLY == *" $1 "* ]]; }  # wanted GROUP: whether $ONLY names this group of steps

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
    study=(--tiny --device cpu --seeds 2)
    study_name=study-data-scaling-tiny
    study_limit=120  # its cells take seconds; the margin is for a CPU shared with other work
    # the recipes' runs, a few steps each on a few images (their test split still whole), on the CPU
    recipes_set=(--set device=cpu --set compile=false --set steps=4 --set eval_every=2 --set data.limit=600
                 --set data.holdout=100)
    recipes_record=0  # no records in benchmarks/results
    recipes_limit=240
else
    bench=(--repeats 20 --warmup 3 --profile 12)
    train_set=()
    tests=(tests -n 8 -rf --tb=short)  # 8 workers of 2 threads each (OMP_NUM_THREADS below) on 16 cores
    study=(--device cuda --seeds 5)
    study_name=study-data-scaling
    study_limit=240  # both study steps and the report fit one 10-minute call of the device tool
    recipes_set=(--set threads=3)  # five runs on 16 cores
    recipes_record=1
    recipes_limit=${RECIPES_LIMIT:-480}
fi
have_data() {
    "$PY" -c "import sys; from vitkit.data.fashion_mnist import find_fashion_mnist as f; sys.exit(not (f('train') and f('test')))"
}

if wanted machine; then
step machine 60 bash -c "nvidia-smi -L 2>/dev/null || echo 'no nvidia-smi'; \
    $PY -c 'import sys, torch, timm; print(sys.version.split()[0], \"torch\", torch.__version__, \"timm\", \
timm.__version__, \"cuda\", torch.cuda.is_available() and torch.cuda.get_device_name(0))'"
fi

if wanted bench; then
step bench_inference 180 "$PY" benchmarks/bench_gpu.py "${bench[@]}" --only inference \
    --json "$OUT/gpu-infer_${where}_${day}.json"
step bench_training 200 "$PY" benchmarks/bench_gpu.py "${bench[@]}" --only training \
    --json "$OUT/gpu-train_${where}_${day}_run1.json"
# The eager training step is bound by the host's kernel launches (docs/speed.md): CUDA graphs are the lever.
step bench_training_cudagraphs 200 "$PY" benchmarks/bench_gpu.py "${bench[@]}" --only training \
    --train-compile-mode reduce-overhead --json "$OUT/gpu-train_${where}_${day}_cudagraphs.json"
fi

if wanted train && have_data; then
    run="${TMPDIR:-/tmp}/vitkit-gpu-demo"  # outside $OUT: the device tool brings back 8 files at most
    rm -rf "$run"
    step train_demo 80 "$PY" -m vitkit.cli.main train demo --out "$run" --no-progress "${train_set[@]}"
    step eval_demo 40 "$PY" -m vitkit.cli.main eval "$run/last" --data fashion-mnist --out "$run/eval"
    cp "$run/result.json" "$OUT/recipe-demo_${where}_${day}.json" 2>/dev/null
    cp "$run/metrics.csv" "$OUT/demo_metrics.csv" 2>/dev/null
    cp "$run/eval/metrics.json" "$OUT/demo_eval.json" 2>/dev/null
elif wanted train; then
    echo "== train_demo: skipped (no Fashion-MNIST; set VITKIT_DATA to a folder holding fashion-mnist/)"
fi

if wanted study && have_data; then
    # The records go to a folder outside $OUT (one file a cell) and come back as one archive. Seed by seed,
    # the study's 15 cells then the ablations' 6: a run cut short by its limit still holds whole seeds.
    name="${study_name}_${where}"
    records="${TMPDIR:-/tmp}/vitkit-gpu-study/$name"
    step study "$study_limit" "$PY" benchmarks/study_data_scaling.py "${study[@]}" --out "$records" \
        --time-limit $((study_limit * 2 / 3))
    step study_ablations "$study_limit" "$PY" benchmarks/study_data_scaling.py "${study[@]}" --ablations \
        --out "$records" --time-limit $((study_limit * 2 / 3))
    step study_report 60 "$PY" benchmarks/study_data_scaling.py "${study[@]}" --out "$records" --report
    tar -czf "$OUT/$name.tar.gz" -C "$(dirname "$records")" "$name"
elif wanted study; then
    echo "== study: skipped (no Fashion-MNIST; set VITKIT_DATA to a folder holding fashion-mnist/)"
fi

if wanted recipes && have_data; then
    # Fashion-MNIST's strongest recipes, several runs at once on the one GPU (each is bound by its host's
    # kernel launches, not by the GPU): a convolutional teacher at 112 px (the BiT stem's stride 4 then sees
    # the 28-pixel images at their own resolution, a 7x7 map after three stages), then ViT students it
    # teaches (DeiT's hard distillation) at fashion-mnist-long's width, three seeds, and that recipe untaught
    # beside them.
    # Every run chooses on its 5,000 held-out images and reports the test split once, at the end. Each run
    # writes its record (benchmarks/fashion_mnist.py --record); records, logs, metrics and the final models
    # come back as one archive. All runs stop at $recipes_limit seconds from the start of this step.
    runs="${TMPDIR:-/tmp}/vitkit-gpu-recipes"
    rm -rf "$runs" && mkdir -p "$runs"
    deadline=$(( $(date +%s) + recipes_limit ))
    fm() {  # fm TAG RECIPE [--set K=V]...: one recorded run, cut at the deadline; its output in $runs/TAG.log
        local tag=$1 recipe=$2 start rec=()
        start=$(date +%s)
        shift 2
        [ "$recipes_record" = 1 ] && rec=(--record "$tag")
        timeout $(( deadline - start )) "$PY" benchmarks/fashion_mnist.py --recipe "$recipe" \
            --out "$runs/$tag" "${recipes_set[@]}" "${rec[@]}" "$@" >"$runs/$tag.log" 2>&1
        echo "-- $tag: exit $? after $(( $(date +%s) - start )) s: $(tail -n 1 "$runs/$tag.log")"
        grep -h "test top-1" "$runs/$tag.log"
    }
    student_epochs() {  # as many of 100 epochs as fit before the deadline, at the rate the untaught twin (the
        # same model and batch) has trained so far, taken at 60 % for four runs sharing the GPU; 100 untimed
        "$PY" - "$runs/long-b512-s0/metrics.csv" "$deadline" <<'EOF'
import csv, math, sys, time
try:
    rows = [r for r in csv.DictReader(open(sys.argv[1])) if r["split"] == "train"]
    rate = (int(rows[-1]["step"]) - int(rows[0]["step"])) / (float(rows[-1]["time"]) - float(rows[0]["time"]))
except (OSError, IndexError, KeyError, ValueError, ZeroDivisionError):
    print(100)
    sys.exit()
left = float(sys.argv[2]) - time.time() - 90  # compiling twice, the test split and its fp32 evaluation
print(max(10, min(100, int(0.6 * rate * left / math.ceil(55_000 / 512)))))
EOF
    }
    # the students and their untaught twin: fashion-mnist-long's model at batch 512 (half the steps, each
    # no slower on a GPU), its lr scaled by about the square root of the batch
    wide=(--set batch_size=512 --set optim.lr=4e-3)
    fm teacher112 fashion-mnist-teacher --set model.image_size=112 --set epochs=30 &
    teacher=$!
    fm long-b512-s0 fashion-mnist-long "${wide[@]}" &
    wait "$teacher"
    epochs=$(student_epochs)
    echo "-- the students train for $epochs epochs"
    student=(--set model.dim=128 --set model.mlp_dim=256 --set "epochs=$epochs" "${wide[@]}")
    if [ -d "$runs/teacher112/best" ]; then
        for seed in 0 1 2; do
            fm "distilled-wide-s$seed" fashion-mnist-distilled --set "teacher=$runs/teacher112/best" \
                "${student[@]}" --set "seed=$seed" &
        done
    else
        failed=$((failed + 1))
    fi
    wait
    cp benchmarks/results/recipe-*_"${where}"_"${day}"_*.json "$runs/" 2>/dev/null
    # one archive of the records, logs and metrics, and one a run of its model (the teacher's best, the
    # students' final weights): the device tool brings back files of 16 MiB at most
    tar -czf "$OUT/recipes_${where}.tar.gz" -C "$runs" --exclude=ckpt --exclude=best --exclude=last .
    for run in "$runs"/*/; do
        tag=$(basename "$run")
        model=last && [ -d "$run/best" ] && [[ $tag == teacher* ]] && model=best
        [ -d "$run/$model" ] && tar -czf "$OUT/model-${tag}.tar.gz" -C "$runs" "$tag/$model"
    done
    ls -la "$OUT"
elif wanted recipes; then
    echo "== recipes: skipped (no Fashion-MNIST; set VITKIT_DATA to a folder holding fashion-mnist/)"
fi

if wanted tests; then
step tests 150 env OMP_NUM_THREADS=2 "$PY" -m pytest -q -p no:cacheprovider "${tests[@]}"
fi
echo "== $failed step(s) failed"
exit "$failed"
