#!/usr/bin/env bash
# The GPU checks in one batch, for a session that has a CUDA machine (issue 67): at most 9 minutes in all.
#
#     benchmarks/gpu_checks.sh                 # every step, in this order
#     benchmarks/gpu_checks.sh decode percall  # only the steps named
#
# Steps (each under `timeout`, its stdout and stderr in $OUT/<step>.log):
#   launch     tests/unit/core/test_triton_launch.py: the cast's Triton kernel launched without Triton's JIT after its
#              first launch (hmp/core/triton_launch.py): torch's bits, no JIT launch after the first per
#              specialisation, a side stream, a CUDA graph; prints host µs per cast, direct and through the JIT
#   castbench  ../shared/gpu/castbench.py: host cost of one saturating cast, its bits against the stock ops
#   percall    benchmarks/percall.py --device cuda --reps 5 --calls 200 (-> percall.json)
#   gpu        benchmarks/gpu.py --parts train,decode: GPT-2 124M eager training, TinyLlama-shape decode (-> gpu.md)
#   accum      ../shared/gpu/accum.py: GPT-2 124M, 4 micro-batches per step, hmp.accumulation()
#   decode     benchmarks/decode.py --only-compiled --device cuda --layers 1 --tokens 16 --rounds 5: compiled
#              decode (reduce-overhead, CUDA graphs) of fp32, autocast, hmp O1 and bf16 (-> decode_compiled.json);
#              its target: compiled hmp O1 at most 1.05x compiled autocast (reported, not asserted)
#
# Outputs go under $OUT if set, else /tmp/gpu_out; summary.tsv there has each step's exit status and seconds
# (124: it ran past its timeout). A step that fails does not stop the others; the script exits 1 if any failed.
# Each step's timeout is cut to what is left of the budget (GPU_CHECKS_BUDGET_S, default 530 s), and a step
# with under 10 s left is skipped. Runs from the project root; the shared scripts are looked for in
# $HMP_SHARED_GPU, ../shared/gpu, then shared/gpu. PYTHON picks the interpreter (default: python).

set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
OUT="${OUT:-/tmp/gpu_out}"
mkdir -p "$OUT" || exit 2
PY="${PYTHON:-python}"
BUDGET="${GPU_CHECKS_BUDGET_S:-530}"
KILL_AFTER=5 # seconds between timeout's TERM and its KILL
export PYTHONPATH="$ROOT:$ROOT/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 # a step killed at its timeout still leaves what it printed

SHARED=""
for d in "${HMP_SHARED_GPU:-}" ../shared/gpu shared/gpu; do
    if [ -n "$d" ] && [ -f "$d/castbench.py" ]; then
        SHARED="$d"
        break
    fi
done
[ -n "$SHARED" ] || SHARED=../shared/gpu # missing: its steps fail (status 2), the others run

SUMMARY="$OUT/summary.tsv"
printf 'step\tstatus\tseconds\ttimeout_s\tlog\n' >"$SUMMARY"
FAILED=0
SECONDS=0

log() { echo "gpu_checks: $*" >&2; }

# step NAME TIMEOUT_S COMMAND...: runs COMMAND under timeout, logs to $OUT/NAME.log, records the outcome
step() {
    local name="$1" limit="$2"
    shift 2
    local left=$((BUDGET - SECONDS - KILL_AFTER))
    if [ "$left" -lt "$limit" ]; then limit="$left"; fi
    if [ "$limit" -lt 10 ]; then
        log "$name: skipped, ${left} s left of the ${BUDGET} s budget"
        printf '%s\tskipped\t0\t0\t-\n' "$name" >>"$SUMMARY"
        FAILED=1
        return
    fi
    log "$name (timeout ${limit} s, at ${SECONDS} s): $*"
    local start=$SECONDS
    timeout -k "$KILL_AFTER" "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    local took=$((SECONDS - start))
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$took" "$limit" "$OUT/$name.log" >>"$SUMMARY"
    if [ "$rc" -eq 0 ]; then
        log "$name: ok in ${took} s"
    else
        FAILED=1
        if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
            log "$name: timed out after ${took} s (exit $rc); last lines:"
        else
            log "$name: failed, exit $rc after ${took} s; last lines:"
        fi
        tail -n 5 "$OUT/$name.log" >&2
    fi
}

run_step() {
    case "$1" in
    launch) step launch 60 "$PY" -m pytest -q -s -p no:cacheprovider tests/unit/core/test_triton_launch.py ;;
    castbench) step castbench 50 "$PY" "$SHARED/castbench.py" ;;
    percall) step percall 50 "$PY" benchmarks/percall.py --device cuda --reps 5 --calls 200 --json "$OUT/percall.json" ;;
    gpu) step gpu 150 "$PY" benchmarks/gpu.py --parts train,decode --out "$OUT/gpu.md" ;;
    accum) step accum 70 "$PY" "$SHARED/accum.py" ;;
    decode)
        step decode 180 "$PY" benchmarks/decode.py --only-compiled --device cuda --layers 1 --tokens 16 --rounds 5 \
            --json "$OUT/decode_compiled.json"
        ;;
    *)
        log "unknown step $1 (launch, castbench, percall, gpu, accum, decode)"
        printf '%s\tunknown\t0\t0\t-\n' "$1" >>"$SUMMARY"
        FAILED=1
        ;;
    esac
}

{
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    timeout 20 nvidia-smi -L 2>&1
    timeout 30 "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' 2>&1
} >"$OUT/env.txt"
cat "$OUT/env.txt" >&2

if [ "$#" -eq 0 ]; then set -- launch castbench percall gpu accum decode; fi
for s in "$@"; do run_step "$s"; done

log "done in ${SECONDS} s; outcomes in $SUMMARY:"
column -t -s "$(printf '\t')" "$SUMMARY" >&2 2>/dev/null || cat "$SUMMARY" >&2
exit "$FAILED"
