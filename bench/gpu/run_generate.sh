#!/usr/bin/env bash
# The generation benchmark (bench/generation/compare.py) on a CUDA GPU, then the decode step time against the
# memory-bandwidth bound (bench/generation/decode_bound.py). See bench/gpu/README.md.
#
#   bench/gpu/run_generate.sh                          # SmolLM2-135M, bf16, c1,8,32,64, H200 bandwidth
#   MODEL=/path/to/hf-folder BANDWIDTH_GBS=3350 bench/gpu/run_generate.sh --legs zserve,static
#
# Extra arguments go to bench/generation/compare.py.
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-smollm2}
DEVICE=${DEVICE:-cuda}
BANDWIDTH_GBS=${BANDWIDTH_GBS:-4800}   # H200 HBM3e; H100 SXM 3350, A100 80GB 2039
CONCURRENCY=${CONCURRENCY:-1,8,32,64}
REQUESTS=${REQUESTS:-1:8,8:2,32:1,64:1}  # the single leg (one request at a time) dominates the run time
THREADS=${THREADS:-4}
OUT=${OUT:-bench/results}

"$PY" - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"run_generate.sh: no CUDA device for torch {torch.__version__} (the repo pins the CPU wheel; "
             "install a CUDA build of the same torch version in this venv first)")
p = torch.cuda.get_device_properties(0)
print(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}")
PY

"$PY" -m bench.generation --device "$DEVICE" --dtype bfloat16 --model "$MODEL" --threads "$THREADS" \
    --concurrency "$CONCURRENCY" --requests-per-caller "$REQUESTS" --max-batched-tokens 2048 \
    --out "$OUT/issue4-generate-gpu.json" "$@" || status=$?

"$PY" -m bench.generation decode-bound --device "$DEVICE" --dtype bfloat16 --model "$MODEL" --threads "$THREADS" \
    --batch "$CONCURRENCY" --bandwidth-gbs "$BANDWIDTH_GBS" --out "$OUT/issue4-decode-bound-gpu.json"
exit "${status:-0}"
