#!/usr/bin/env bash
# One short GPU slot's checks, most wanted first, each under its own time limit so that a slow one
# leaves the next its time: the CUDA test lane, then benchmark passes with a profiler trace of each case.
# Everything lands in $OUT (at most 8 files): env.txt, lane.log, lane.xml, bench.log, bench.json (one
# report per pass), summary.md (where each traced step's time goes) and traces.tar.gz (the chrome
# traces that fit in 15 MiB, first runs first).
#
#   OUT=results LANE_S=230 BENCH_S=320 PASSES='|1B default,1B compile' bash scripts/benchmark/device_check.sh
#
# PASSES: one benchmark run per line, "TRAIN.PY FLAGS|CASES" (cases of the $PRESET preset, h100 by default,
# scripts/benchmark/cases.py, run in that order; the flags apply to each of them): the same case under other flags
# in the same sitting measures a change before and after. LANE_S=0 skips the lane.
set -u
: "${OUT:?set OUT to the folder for the results}" "${PASSES:?set PASSES to FLAGS|CASES lines}"
LANE_S=${LANE_S:-240} BENCH_S=${BENCH_S:-300} STEPS=${STEPS:-12} WARMUP=${WARMUP:-4} PRESET=${PRESET:-h100}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
    python3 -m pip list 2>/dev/null | grep -E '^(torchao|torchdata|datasets|transformers) '
} >"$OUT/env.txt" 2>&1

if [ "$LANE_S" -gt 0 ]; then
    start=$SECONDS
    timeout -k 10 "$LANE_S" python3 -m pytest -m cuda -n 4 --dist load -o addopts="" --timeout 300 --durations 20 \
        -rfEs --junitxml "$OUT/lane.xml" >"$OUT/lane.log" 2>&1
    echo "lane: exit status $? after $((SECONDS - start)) s" | tee -a "$OUT/lane.log"
fi

work=$(mktemp -d)
deadline=$((SECONDS + BENCH_S))
pass=0
while IFS='|' read -r flags cases; do
    [ -z "$cases" ] && continue
    left=$((deadline - SECONDS))
    [ "$left" -le 10 ] && { echo "pass $pass and after: no time left" | tee -a "$OUT/bench.log"; break; }
    pass=$((pass + 1))
    echo "== pass $pass: ${flags:-no extra flags} | $cases" | tee -a "$OUT/bench.log"
    # shellcheck disable=SC2086  # the flags are words
    timeout -k 10 "$left" python3 -m scripts.benchmark --preset "$PRESET" --steps "$STEPS" --warmup "$WARMUP" --timeout 200 \
        --cases "$cases" --json "$work/pass-$pass.json" --traces "$work/traces-$pass" $flags >>"$OUT/bench.log" 2>&1
    echo "pass $pass: exit status $? after $((SECONDS - deadline + BENCH_S)) s in all" | tee -a "$OUT/bench.log"
    { echo "## pass $pass: ${flags:-no extra flags}"; echo; cat "$work/traces-$pass/summary.md" 2>/dev/null; } \
        >>"$OUT/summary.md"
    for trace in "$work/traces-$pass"/*.json; do
        [ -e "$trace" ] && mv "$trace" "$work/trace-${pass}_$(basename "$trace")"
    done
done <<<"$PASSES"
python3 -c 'import json, sys; print(json.dumps([json.load(open(f)) for f in sys.argv[1:]], indent=1))' \
    "$work"/pass-*.json >"$OUT/bench.json" 2>>"$OUT/bench.log"

kept=()
for trace in $(cd "$work" && ls -tr trace-*.json 2>/dev/null); do
    kept+=("$trace")
    tar czf "$work/try.tar.gz" -C "$work" "${kept[@]}"
    [ "$(stat -c %s "$work/try.tar.gz")" -gt $((15 << 20)) ] && { unset 'kept[-1]'; break; }
    mv "$work/try.tar.gz" "$OUT/traces.tar.gz"
done
echo "traces kept: ${kept[*]:-none}" | tee -a "$OUT/bench.log"
tail -n 30 "$OUT/lane.log" 2>/dev/null
grep -v '^\s*$' "$OUT/bench.log" | grep -v '^\[' | tail -n 60
