#!/usr/bin/env bash
# The whole CPU speed measurement in one command: RUNS full runs one after another (3 by default), each
# `vitkit bench` at batch 1 (8 rounds) and at batch 16 (4 rounds, 1 warm-up) for ViT-S/16 and ViT-B/16 with
# every CPU contender, then `vitkit bench --runtimes` at batch 1 and 16 (optimize's fp32, int8 and, on a CPU
# with native bf16, bf16 models against ONNX Runtime and OpenVINO at the same precision, timm eager and
# compiled; needs the bench-runtimes extra, RUNTIMES=0 leaves it out), then the training step against timm
# eager and compiled (benchmarks/bench_training.py: vitkit as the trainer runs it, and on each engine of its
# products alone); with AGREEMENT_CHECKPOINT set,
# int8's top-1 agreement with fp32 on Fashion-MNIST as well; then benchmarks/check_targets.py over all the
# runs, which prints which speed targets hold.
#
#   bash benchmarks/target_runs.sh [OUT_DIR]
#   RUNS=1 AGREEMENT_CHECKPOINT=runs/demo/best bash benchmarks/target_runs.sh
#
# The records go to OUT_DIR (default benchmarks/results), named as benchmarks/results/README.md says:
# infer-b1_<cpu>_<date>_run<i>.json, infer-b16_..., infer-runtimes_..., train-step_...,
# int8-agreement_<cpu>_<date>.json. About 45 minutes a run on 2 cores. Run nothing else meanwhile: the ratios are paired within each process, but a
# machine busy with other work shifts them (docs/speed.md). The exit status is check_targets.py's: 0 when
# every target holds in every run, 1 when one does not.
#
# Settings (environment): RUNS (3), THREADS (2), MODELS ("ViT-S/16 ViT-B/16"), B1_REPEATS (8), B16_REPEATS
# (4), RUNTIMES (1), RUNTIME_REPEATS (5), TRAIN_ARGS ("--repeats 8 --engines"), AGREEMENT_CHECKPOINT
# (unset: no agreement), PYTHON (.venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:-benchmarks/results}
py=${PYTHON:-.venv/bin/python}
runs=${RUNS:-3}
threads=${THREADS:-2}
read -r -a models <<< "${MODELS:-ViT-S/16 ViT-B/16}"
read -r -a train_args <<< "${TRAIN_ARGS:---repeats 8 --engines}"
b1_repeats=${B1_REPEATS:-8}
b16_repeats=${B16_REPEATS:-4}
runtimes=${RUNTIMES:-1}
runtime_repeats=${RUNTIME_REPEATS:-5}

if ! [[ $runs =~ ^[1-9][0-9]*$ ]]; then
  echo "target_runs.sh: RUNS must be a positive whole number, got '$runs'" >&2
  exit 2
fi
if [[ -n ${AGREEMENT_CHECKPOINT:-} && ! -e $AGREEMENT_CHECKPOINT ]]; then
  echo "target_runs.sh: AGREEMENT_CHECKPOINT '$AGREEMENT_CHECKPOINT' does not exist" >&2
  exit 2
fi
mkdir -p "$out"
name() {  # name WHAT [TAG]: the record's path in $out
  "$py" benchmarks/records.py name "$1" ${2:+--tag "$2"} --folder "$out"
}

model_args=()
for m in "${models[@]}"; do model_args+=(-m "$m"); done
contenders=(-c vitkit -c vitkit-fp32-opt -c vitkit-int8 -c timm -c hf-sdpa -c torchvision)
# --runtimes adds vitkit-bf16 (native bf16 only), timm-compiled and the runtimes at each precision
runtime_contenders=(-c vitkit-fp32-opt -c vitkit-int8 -c timm --runtimes)
check_args=()

for i in $(seq 1 "$runs"); do
  b1=$(name infer-b1 "run$i") b16=$(name infer-b16 "run$i") train=$(name train-step "run$i")
  rt=$(name infer-runtimes "run$i")
  echo "== run $i of $runs ($(date +%H:%M:%S)), files in $out"
  "$py" -m vitkit.cli.main bench "${model_args[@]}" -b 1 -r "$b1_repeats" "${contenders[@]}" \
    --threads "$threads" --json "$b1"
  "$py" -m vitkit.cli.main bench "${model_args[@]}" -b 16 -r "$b16_repeats" --warmup 1 "${contenders[@]}" \
    --threads "$threads" --json "$b16"
  files="$b1,$b16"
  if [[ $runtimes != 0 ]]; then
    "$py" -m vitkit.cli.main bench "${model_args[@]}" -b 1 -b 16 -r "$runtime_repeats" --warmup 1 \
      "${runtime_contenders[@]}" --threads "$threads" --json "$rt"
    files+=",$rt"
  fi
  "$py" benchmarks/bench_training.py --threads "$threads" "${train_args[@]}" --json "$train"
  files+=",$train"
  if [[ -n ${AGREEMENT_CHECKPOINT:-} && $i == 1 ]]; then
    agreement=$(name int8-agreement)
    "$py" benchmarks/bench_inference.py agreement --checkpoint "$AGREEMENT_CHECKPOINT" --threads "$threads" \
      --json "$agreement"
    files+=",$agreement"
  fi
  check_args+=(--run "$files")
done

echo "== the speed targets over $runs run(s)"
"$py" benchmarks/check_targets.py "${check_args[@]}"
