#!/usr/bin/env bash
# What needs a CUDA GPU, in one call of a GPU machine: the side-by-side decoding benchmark
# (bench_generation_gpu.py: lucidlm eager/compiled/int8/int4 vs transformers), with its check
# that compiled greedy tokens equal eager ones in bf16 on CUDA, bare step times and a profile.
# Needs torch with CUDA and transformers (a GPU image has them; lucidlm's own CPU pin is not
# used here). Results go to $OUT (default benchmarks/results); extra arguments go to the script.
#   OUT=/tmp/gpu bash benchmarks/gpu_checks.sh --int4
# Everything (all engines, batch 1 and 8, the diagnostics) takes more than one session's 15
# minutes of device time; what fits, with the machine's start (438 s of command on 2026-11-27):
#   BENCH_TIMEOUT=500 bash benchmarks/gpu_checks.sh --quick
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)"
timeout "${BENCH_TIMEOUT:-500}" python3 benchmarks/bench_generation_gpu.py --out "$OUT" --diagnose "$@" 2>&1 \
    | tee "$OUT/generation_gpu.log"
status=${PIPESTATUS[0]}
# A run cut short by the timeout still saved its rows: print their table.
python3 - "$OUT" <<'PY'
import json, sys
sys.path.insert(0, "benchmarks")
from bench_generation_gpu import table
results = json.load(open(f"{sys.argv[1]}/generation_gpu.json"))
print("\n" + table(results))
print("errors:", list(results["errors"]) or "none", "| diagnostics:", results.get("diagnostics"))
PY
exit "$status"
