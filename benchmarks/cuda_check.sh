#!/usr/bin/env bash
# GPU check: the model tests on CUDA, then plain-decoding speed and a quick `specsample bench` on one GPU.
#
#   bash benchmarks/cuda_check.sh tests OUT_DIR    # tiny-model tests on CUDA (no real weights needed)
#   bash benchmarks/cuda_check.sh real OUT_DIR     # real SmolLM2 tests, runtime speed, bench (needs the alias)
#   bash benchmarks/cuda_check.sh adaptive OUT_DIR # the adaptive benchmark (fixed gamma 1-4, gamma auto, hybrid auto,
#                                                  # target-only) on Spec-Bench at T 0 and 0.7 (needs the alias);
#                                                  # env SYSTEMS, VARIANTS ('NAME:KNOBS;...'), TEMPERATURES,
#                                                  # PER_CATEGORY, STEP_LIMIT (seconds per temperature)
#   bash benchmarks/cuda_check.sh rounds OUT_DIR   # a round's phases, launches and waits on the GPU (needs the alias)
#   bash benchmarks/cuda_check.sh stalls OUT_DIR   # forward time by shape and attention kernels, then a short
#                                                  # adaptive run per STALL_RUNS (default engine; also torch,
#                                                  # no-cudnn, threads1) and TEMPERATURES (default 0.7 0)
#
# Each step has its own time limit, so one slow step cannot hide the others' results; all output
# goes to OUT_DIR/log.txt. CI never runs this (it has no GPU); docs/cuda.md records what it printed.
set -u
part=${1:?usage: cuda_check.sh tests|real|adaptive|rounds|stalls OUT_DIR}
out=${2:?usage: cuda_check.sh tests|real|adaptive|rounds|stalls OUT_DIR}
py=${PYTHON:-python3}
mkdir -p "$out"
export SPECSAMPLE_TEST_DEVICE=${SPECSAMPLE_TEST_DEVICE:-cuda} PYTHONUNBUFFERED=1

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

if [ "$part" = tests ]; then
    step pytest_models 200 "$py" -m pytest -q -p no:cacheprovider tests/test_exactness.py tests/test_engine.py \
        tests/test_models.py
    step pytest_compiled 120 "$py" -m pytest -q -p no:cacheprovider tests/test_compiled.py
elif [ "$part" = adaptive ]; then
    step generate 80 "$py" -m specsample.cli generate --device cuda --max-new-tokens 48 --seed 0 \
        "Explain speculative decoding in two sentences."  # the main job on the GPU; fetches the alias first
    systems=${SYSTEMS:-'target-only,gamma=1,gamma=2,gamma=3,gamma=4,gamma=auto,hybrid auto'}
    variants=()  # VARIANTS='NAME:KNOBS;NAME:KNOBS': adaptive.py --variant each (a name hybrid... drafts as the hybrid)
    IFS=';' read -ra specs <<<"${VARIANTS:-}"
    for v in ${specs[@]+"${specs[@]}"}; do variants+=(--variant "$v"); done
    for t in ${TEMPERATURES:-0 0.7}; do
        step "adaptive_t$t" "${STEP_LIMIT:-240}" "$py" benchmarks/adaptive.py --device cuda \
            --per-category "${PER_CATEGORY:-3}" --max-new-tokens 64 --temperatures "$t" --systems "$systems" \
            ${variants[@]+"${variants[@]}"} --out "$out/adaptive_cuda_t$t.json"
        # a step cut off by its limit leaves the replies it finished (marked partial) beside: render them
        if [ -f "$out/adaptive_cuda_t$t.partial.json" ]; then
            "$py" benchmarks/adaptive.py --report-only "$out/adaptive_cuda_t$t.partial.json" >>"$out/log.txt" 2>&1 || true
        fi
    done
elif [ "$part" = rounds ]; then  # where a round's time goes on the GPU: phases, launches and waits (~3 min)
    step round_phases 150 "$py" benchmarks/round_phases.py --device cuda --per-category 1 --prompts 6 --tokens 48 \
        --temperatures 0,0.7 --auto --out "$out/round_phases_cuda.json"
    step round_ops 120 "$py" benchmarks/round_ops.py --device cuda --auto --gammas 1,2 --prompts 4 --tokens 32 \
        --out "$out/round_ops_cuda.json"
elif [ "$part" = stalls ]; then  # session 37's fix for the dear rounds of session 36 (~7 min)
    # one forward by tokens scored (one width's calls in a row, widths in turn, widths in turn at a growing context)
    # under the engine's kernels and torch's pick: a cost per attention shape (cuDNN's attention builds a graph per
    # shape) shows as growing >> turns under torch's pick, and should not under the engine's; each table is followed
    # by the SDPA implementation the forwards dispatched (`_scaled_dot_product_cudnn_attention` is cuDNN's)
    step forward_shapes 120 "$py" benchmarks/forward_shapes.py --device cuda --backends engine,torch \
        --out "$out/forward_shapes_cuda.json"
    # then a short adaptive run per STALL_RUNS entry and temperature (rounds keep their phases; round_kinds.py tables
    # them, and splits rounds at shapes met before from new ones): engine (the runtimes' own kernels, since session
    # 37; the default); torch (--attention torch: cuDNN's on Hopper, as every run before session 37: sessions 35 and
    # 36 stored five such runs); no-cudnn (none of cuDNN's anywhere); threads1 (one CPU thread:
    # OpenMP threads that spin under a CPU quota get throttled); each with the hybrid also priced at its rounds'
    # mean cost (stall_costs), interleaved
    unset OMP_NUM_THREADS MKL_NUM_THREADS  # torch's own thread count, not the caller's
    for run in ${STALL_RUNS:-engine}; do
        attention=engine
        case "$run" in
            engine) ;;
            torch | no-cudnn) attention=$run ;;
            threads1) export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 ;;
            *) echo "=== STALL_RUNS: unknown run '$run' (engine, torch, no-cudnn, threads1): skipped" | tee -a "$out/log.txt"
               continue ;;
        esac
        for t in ${TEMPERATURES:-0.7 0}; do
            result="$out/adaptive_cuda_${run}_t$t"
            step "adaptive_${run}_t$t" "${STEP_LIMIT:-150}" "$py" benchmarks/adaptive.py --device cuda \
                --attention "$attention" --per-category 1 --max-new-tokens 64 --temperatures "$t" \
                --systems 'target-only,gamma=1,gamma=auto,hybrid auto' --variant 'hybrid auto stalls:stall_costs=true' \
                --out "$result.json"
            [ -f "$result.json" ] || result="$result.partial"  # cut off by its limit: what it finished
            [ -f "$result.json" ] && "$py" benchmarks/adaptive.py --report-only "$result.json" >/dev/null 2>&1
            echo "=== round kinds of $result.json" >>"$out/log.txt"
            "$py" benchmarks/round_kinds.py "$result.json" >>"$out/log.txt" 2>&1 || true
        done
        unset OMP_NUM_THREADS MKL_NUM_THREADS
    done
else
    step pytest_real 150 "$py" -m pytest -q -p no:cacheprovider tests/test_real_smollm2.py tests/test_shipped_draft.py
    step runtime_speed 100 "$py" benchmarks/runtime_speed.py --device cuda --no-compiled --repeats 5 \
        --out "$out/runtime_speed_cuda.json"
    step bench 420 "$py" -m specsample.cli bench --quick --device cuda --compare hf,hf-assisted,hf-lookup \
        --out "$out/bench"
    tar czf "$out/bench.tgz" -C "$out" bench && rm -rf "$out/bench"  # one file back instead of six
    step runtime_speed_compiled 120 "$py" benchmarks/runtime_speed.py --device cuda --dtypes bfloat16 --repeats 5 \
        --out "$out/runtime_speed_cuda_compiled.json"
fi
