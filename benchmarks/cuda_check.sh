#!/usr/bin/env bash
# GPU check on one CUDA device: the model tests, the main job, plain-decoding speed and the bench suites.
#
#   bash benchmarks/cuda_check.sh tests OUT_DIR   # tiny-model tests on CUDA (no real weights needed)
#   bash benchmarks/cuda_check.sh real OUT_DIR    # the main job, real-model tests and runtime speed (needs the alias)
#   bash benchmarks/cuda_check.sh bench OUT_DIR   # specsample bench on the GPU: the compare suite (target-only,
#                                                 # the default pair, transformers generate and assisted generation
#                                                 # interleaved) eager and --compile, the feature draft, and the
#                                                 # adaptive suite (env PER_CATEGORY, default 2; TEMPERATURES, 0,0.7)
#   bash benchmarks/cuda_check.sh shapes OUT_DIR  # scoring 1..32 tokens at Llama-3-8B and 1B shapes (random weights)
#   bash benchmarks/cuda_check.sh all OUT_DIR     # every part, in that order (a dry run: CUDA_CHECK_DEVICE=cpu)
#
# Each step has its own time limit, so one slow step cannot hide the others' results; all output goes to
# OUT_DIR/log.txt and each step's results into OUT_DIR. CI never runs this (it has no GPU); docs/runtime.md
# records what it measured.
set -u
part=${1:?usage: cuda_check.sh tests|real|bench|shapes|all OUT_DIR}
out=${2:?usage: cuda_check.sh tests|real|bench|shapes|all OUT_DIR}
py=${PYTHON:-python3}
device=${CUDA_CHECK_DEVICE:-cuda}
mkdir -p "$out"
export SPECSAMPLE_TEST_DEVICE=${SPECSAMPLE_TEST_DEVICE:-$device} PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: run with a time limit, append its output to OUT/log.txt
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "=== step $name (limit $limit s): $*" >>"$out/log.txt"
    timeout "$limit" "$@" >>"$out/log.txt" 2>&1
    local rc=$?
    echo "=== step $name: exit $rc after $((SECONDS - start)) s" | tee -a "$out/log.txt"
}

"$py" -c 'import platform, torch, transformers
print("python", platform.python_version(), "torch", torch.__version__, "transformers", transformers.__version__)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device")' | tee -a "$out/log.txt"

run_part() {
case "$1" in
tests)
    step pytest_models 240 "$py" -m pytest -q -p no:cacheprovider tests/test_exactness.py tests/test_engine.py \
        tests/test_models.py tests/test_golden.py tests/test_verify_tree.py -m "not slow"
    step pytest_compiled 120 "$py" -m pytest -q -p no:cacheprovider tests/test_compiled.py
    ;;
real)
    step generate 80 "$py" -m specsample.cli generate --device "$device" --max-new-tokens 48 --seed 0 \
        "Explain speculative decoding in two sentences."  # the main job on the GPU; fetches the alias first
    step pytest_real 200 "$py" -m pytest -q -p no:cacheprovider tests/test_real_smollm2.py tests/test_shipped_draft.py
    step runtime_speed 150 "$py" benchmarks/runtime_speed.py --device "$device" --dtypes bfloat16 --repeats 5 \
        --out "$out/runtime_speed.json"
    ;;
bench)
    for mode in eager compile; do
        flag=$([ "$mode" = compile ] && echo --compile || true)
        step "bench_compare_$mode" 240 "$py" -m specsample.cli bench --device "$device" --suite compare $flag \
            --compare hf,hf-assisted --num-prompts "${PER_CATEGORY:-2}" --max-new-tokens 64 \
            --temperature "${TEMPERATURES:-0,0.7}" --out "$out/bench_compare_$mode"
    done
    step bench_feature_draft 200 "$py" -m specsample.cli bench --device "$device" --suite compare \
        --draft hybrid:smollm2-135m-instruct-eagle --num-prompts "${PER_CATEGORY:-2}" --max-new-tokens 64 \
        --temperature "${TEMPERATURES:-0,0.7}" --out "$out/bench_feature_draft"
    step bench_adaptive 200 "$py" -m specsample.cli bench --device "$device" --suite adaptive \
        --num-prompts "${PER_CATEGORY:-2}" --max-new-tokens 64 --temperature "${TEMPERATURES:-0,0.7}" \
        --gamma auto,1,2,3,4 --out "$out/bench_adaptive"
    ;;
shapes)
    for shape in llama-1b llama-8b; do
        step "scoring_$shape" 120 "$py" benchmarks/scoring_cost.py --device "$device" \
            --shape "$([ "$device" = cpu ] && echo tiny || echo $shape)" --out "$out/scoring_$shape.json"
    done
    ;;
*)
    echo "unknown part $1: tests, real, bench, shapes or all" >&2
    exit 2
    ;;
esac
}

if [ "$part" = all ]; then
    for each in tests shapes real bench; do run_part "$each"; done
else
    run_part "$part"
fi
