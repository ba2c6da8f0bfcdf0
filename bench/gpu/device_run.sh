#!/usr/bin/env bash
# The GPU check in one call on a lent device (bench/gpu/README.md): the carried wheels, the versions, a smoke of
# about a minute, then gen_check and embed_dtype, every result under $OUT as it goes (5 files). Each part has its
# own time limit, so that a part that hangs leaves the next its time; the status is 1 when any part failed.
#
#   make gpu-wheels                      # here, once: msgspec and pyzmq for CPython 3.12 into .whl/ (~1 MiB)
#   bench/gpu/device_run.sh              # there (device tool: carry [".whl"]); about 5 minutes on an H100
#   DRY=1 PY=venv/bin/python OUT=dir bench/gpu/device_run.sh   # a CPU, tiny sizes, triton interpreted: the
#                                        # stand-in for the image (tests/unit/test_gpu_image_standin.py)
set -uo pipefail
cd "$(dirname "$0")/../.."

PY=${PY:-python3}
OUT=${OUT:-bench/results/device}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/zserve-gpu-site}
DRY=${DRY:-0}
PARTS=${PARTS:-smoke gen_check embed_dtype}  # a subset runs only those (after the wheels and the versions)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/device_run.log") 2>&1
started=$SECONDS
failed=()

# 1. What the image lacks (pyzmq, msgspec), from the carried wheels, into a folder of its own on the path (no
#    write into the image's environment). pip where it works; a wheel is a zip, so unzipping is the fallback.
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl ||
        "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
            "$SITE" "$WHEELS"/*.whl || failed+=(wheels)
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    echo "installed into $SITE: $(cd "$WHEELS" && ls -- *.whl | tr '\n' ' ')"
else
    echo "no wheels in $WHEELS (make gpu-wheels): zserve's imports may fail"
fi

# 2. Versions, and whether each module the checks import is there.
"$PY" - "$OUT/versions.json" <<'PY' || failed+=(versions)
import importlib, json, platform, sys
out = {"python": platform.python_version()}
for name in ("torch", "triton", "transformers", "sentence_transformers", "numpy", "msgspec", "zmq"):
    try:
        out[name] = getattr(importlib.import_module(name), "__version__", "?")
    except Exception as exc:
        out[name] = f"missing ({exc!r})"
import torch
out["cuda"] = torch.version.cuda
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    out["gpu"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs"
import zserve.generator.step_core  # noqa: F401  the import path every check takes
out["zserve_imports"] = "ok"
print(json.dumps(out, indent=1))
open(sys.argv[1], "w").write(json.dumps(out, indent=1))
PY

part() {  # part NAME SECONDS COMMAND...: one check, under its own limit, its status recorded
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    [[ " $PARTS " == *" $name "* ]] || return 0
    echo "== $name (limit ${limit} s)"
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || failed+=("$name")
}

if [ "$DRY" = 1 ]; then
    # the CPU: the smoke through triton's interpreter, gen_check's torch leg, embed_dtype on a small model
    export TRITON_INTERPRET=1 ZSERVE_TRITON_ATTENTION=interpret
    part smoke 600 "$PY" -m bench.gpu.smoke --dry --out "$OUT/smoke.json"
    unset TRITON_INTERPRET ZSERVE_TRITON_ATTENTION
    part gen_check 600 "$PY" -m bench.gpu.gen_check --dry --legs torch --out "$OUT/gen_check.json"
    part embed_dtype 300 "$PY" -m bench.gpu.embed_dtype --device cpu --small --batch 2 --seq 8 --iters 1 \
        --out "$OUT/embed_dtype.json"
else
    part smoke 90 "$PY" -m bench.gpu.smoke --out "$OUT/smoke.json"
    part gen_check 200 "$PY" -m bench.gpu.gen_check --out "$OUT/gen_check.json"
    part embed_dtype 50 "$PY" -m bench.gpu.embed_dtype --iters 10 --out "$OUT/embed_dtype.json"
fi

echo "device_run: $((SECONDS - started)) s; ${#failed[@]} failed${failed[*]:+: ${failed[*]}}"
[ "${#failed[@]}" -eq 0 ]
