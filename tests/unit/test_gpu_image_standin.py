"""A stand-in for the GPU machine's image on this CPU: a virtualenv holding only the image's kinds of packages (torch,
triton, transformers, sentence-transformers and what they require; no pyzmq, no msgspec), into which
bench/gpu/device_run.sh installs the carried wheels (``make gpu-wheels`` for this machine's Python) the way it does
on the device, then runs its CPU-runnable parts: the smoke through triton's interpreter, gen_check's torch leg and
embed_dtype on a small model (DRY=1). It proves the device script gets past its imports before a device is lent.

The virtualenv reuses the test environment's installed packages instead of downloading them again: a folder of
links to each wanted distribution's files (their RECORD), named in a .pth file. Short in CI (the wheels, the
versions and every import the checks take, embed_dtype; 81 s on 2 shared cores); ZSERVE_SLOW=1 runs every dry
part, over the image's versions of transformers (5.17.0) and sentence-transformers (6.0.1) from the registry
(about 7 minutes on 2 shared cores)."""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SLOW = os.environ.get("ZSERVE_SLOW") == "1"
# pip too: the image has one (device_run.sh installs the wheels with it), linked like the rest rather than put in
# by the venv's ensurepip (3 s on 2 shared cores)
IMAGE_ROOTS = ("torch", "triton", "transformers", "sentence-transformers", "numpy", "pip")
ABSENT = {"pyzmq", "msgspec"}  # what the image lacks, carried as wheels
# ZSERVE_SLOW=1: the image's own versions of the model libraries over the linked ones (from the registry; what
# transformers 5.17 needs beside them, which 5.24 no longer does: huggingface-hub 1.x, httpx)
IMAGE_PINS = ["transformers==5.17.0", "sentence-transformers==6.0.1", "huggingface-hub==1.33.0", "httpx", "httpcore",
              "certifi"]  # fmt: skip


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_distributions() -> list[metadata.Distribution]:
    """The roots and everything they require (extras aside), as installed here."""
    found: dict[str, metadata.Distribution] = {}
    todo = list(IMAGE_ROOTS)
    while todo:
        name = _norm(todo.pop())
        if name in found or name in ABSENT:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        found[name] = dist
        todo += [re.match(r"[A-Za-z0-9_.-]+", r).group(0) for r in dist.requires or [] if "extra ==" not in r]
    return list(found.values())


def image_venv(root: Path) -> Path:
    """A virtualenv (no system site) whose only packages are ``image_distributions``, linked in; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=120)
    links = root / "image-site"
    links.mkdir()
    for dist in image_distributions():
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            source = Path(dist.locate_file(top))
            if top not in ("..", "__pycache__") and source.exists() and not (links / top).exists():
                (links / top).symlink_to(source)
    python = root / "venv" / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    (Path(purelib) / "image.pth").write_text(f"{links}\n")
    return python


@pytest.mark.timeout(1800 if SLOW else 300)
def test_the_device_script_runs_in_a_stand_in_for_the_gpu_image(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("make is needed for the wheels")
    started = time.perf_counter()
    wheels = tmp_path / "whl"
    for_python = f"GPU_PYTHON={sysconfig.get_python_version()}"
    make = ["make", "-s", "gpu-wheels", for_python, f"GPU_WHEELS={wheels}", f"PYTHON={sys.executable}"]
    fetched = subprocess.run(make, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr
    assert sum(w.stat().st_size for w in wheels.glob("*.whl")) < 8 << 20  # carried beside a 64 MiB tree
    python = image_venv(tmp_path)
    if SLOW:
        pins = [str(python), "-m", "pip", "install", "--quiet", "--no-deps", *IMAGE_PINS]
        subprocess.run(pins, check=True, capture_output=True, timeout=600)
    probe = "import importlib.util as u; print([m for m in ('zmq', 'msgspec', 'torch', 'triton', 'transformers', "
    probe += "'sentence_transformers') if u.find_spec(m)])"
    seen = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert seen.stdout.strip() == "['torch', 'triton', 'transformers', 'sentence_transformers']", seen

    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "ZSERVE_TRITON", "VIRTUAL_ENV"))}
    env |= {"DRY": "1", "PY": str(python), "OUT": str(out), "WHEELS": str(wheels), "SITE": str(tmp_path / "site")}
    if not SLOW:
        env["PARTS"] = "embed_dtype"  # the wheels, the versions (every import) and the quickest part
    run = subprocess.run(["bash", "bench/gpu/device_run.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=1700 if SLOW else 280)  # fmt: skip
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    # installed by the image's pip (pip writes INSTALLER), not by the script's unzip fallback
    assert {p.name: (p / "INSTALLER").is_file() for p in (tmp_path / "site").glob("*.dist-info")} == {
        f"{name}.dist-info": True for name in ("msgspec-0.23.0", "pyzmq-27.3.0")
    }, log[-4000:]
    versions = json.loads((out / "versions.json").read_text())
    assert versions["zserve_imports"] == "ok" and "missing" not in versions["msgspec"] + versions["zmq"], versions
    if SLOW:
        assert (versions["transformers"], versions["sentence_transformers"]) == ("5.17.0", "6.0.1"), versions
    embed = json.loads((out / "embed_dtype.json").read_text())
    # all that test_embed_gpu_check.py checks of the same command (which runs only where this test cannot, or
    # with ZSERVE_SLOW=1, where the versions here are the image's)
    assert [r["dtype"] for r in embed] == ["float32", "bfloat16"] and all(r["path"] == "zserve" for r in embed)
    assert embed[1]["min_cosine_to_fp32"] > 0.99 and all(r["engine_items_s"] > 0 for r in embed), embed
    if SLOW:
        smoke = json.loads((out / "smoke.json").read_text())
        assert all(part["ok"] for part in smoke["parts"].values()) and len(smoke["parts"]) == 6, smoke
        gen = json.loads((out / "gen_check.json").read_text())
        assert gen["legs"] == ["torch"] and gen["problems"] == [] and len(gen["parity"]) == 3, gen
    how = "every dry part" if SLOW else "short"
    print(f"stand-in for the GPU image: {time.perf_counter() - started:.0f} s ({how})")
