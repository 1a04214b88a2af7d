#!/usr/bin/env bash
# One short GPU slot's checks, most wanted first, each under its own time limit so that a slow one
# leaves the next its time: the CUDA test lane, then benchmark cases with a profiler trace of each.
# Everything lands in $OUT (at most 8 files): env.txt, lane.log, lane.xml, bench.log, bench.json,
# summary.md (where each traced step's time goes) and traces.tar.gz (the chrome traces that fit in 15 MiB).
#
#   OUT=results LANE_S=240 BENCH_S=300 CASES="1B default,1B compile" bash scripts/benchmark/device_check.sh
#
# CASES: names of the h100 preset (scripts/benchmark/cases.py), run in that order; LANE_S=0 skips the lane.
set -u
: "${OUT:?set OUT to the folder for the results}" "${CASES:?set CASES to the h100 cases to run}"
LANE_S=${LANE_S:-240} BENCH_S=${BENCH_S:-300} STEPS=${STEPS:-12} WARMUP=${WARMUP:-4}
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

traces=$(mktemp -d)
start=$SECONDS
timeout -k 10 "$BENCH_S" python3 -m scripts.benchmark --preset h100 --steps "$STEPS" --warmup "$WARMUP" \
    --timeout 200 --cases "$CASES" --json "$OUT/bench.json" --traces "$traces" >"$OUT/bench.log" 2>&1
echo "benchmark: exit status $? after $((SECONDS - start)) s" | tee -a "$OUT/bench.log"
cp "$traces/summary.md" "$OUT/" 2>/dev/null
# The traces, most wanted (first run) first, as many as fit in one file of 15 MiB compressed.
kept=()
for trace in $(ls -tr "$traces"/*.json 2>/dev/null); do
    kept+=("$(basename "$trace")")
    tar czf "$traces/try.tar.gz" -C "$traces" "${kept[@]}"
    [ "$(stat -c %s "$traces/try.tar.gz")" -gt $((15 << 20)) ] && { unset 'kept[-1]'; break; }
    mv "$traces/try.tar.gz" "$OUT/traces.tar.gz"
done
echo "traces kept: ${kept[*]:-none}" | tee -a "$OUT/bench.log"
tail -n 30 "$OUT/lane.log" 2>/dev/null
cat "$OUT/bench.log" | grep -v '^\s*$' | tail -n 40
