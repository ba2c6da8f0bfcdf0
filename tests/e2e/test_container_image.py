"""The Containerfile builds, and the image runs `zserve --help` and a tiny CPU deployment (issue 27 item 1).

Slow (minutes, and ~1.5 GB of packages from PyPI): runs only with ZSERVE_SLOW=1, and only where buildah is
installed (`apt-get install buildah podman mmdebstrap`). Where no base image can be pulled, a minimal Debian
root made by mmdebstrap from this machine's apt sources is imported as the base.

The build and the runs use buildah's chroot isolation, which needs no OCI runtime: on machines where crun
cannot start a container (seen on this project's CI VM: `crun: setrlimit RLIMIT_NOFILE: Operation not
permitted`, then `RLIMIT_NPROC`, since the VM withholds CAP_SYS_RESOURCE, and `cgroups in hybrid mode not
supported`), `podman run` is tried first and its error is reported in the test's output, then the same
commands run through `buildah run --isolation chroot` as the image's user."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "localhost/zserve:test-cpu"
BASE = os.environ.get("ZSERVE_IMAGE_BASE", "localhost/zserve-base:bookworm")
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")  # a TLS-intercepting proxy's CA, where there is one

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("ZSERVE_SLOW") != "1", reason="builds a container image: ZSERVE_SLOW=1"),
    pytest.mark.skipif(shutil.which("buildah") is None, reason="buildah not installed (apt-get install buildah)"),
]


def sh(*argv: str, timeout: int = 1800, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=check)


def base_image(tmp: Path) -> str:
    if sh("buildah", "inspect", "--type", "image", BASE, check=False).returncode == 0:
        return BASE
    if shutil.which("mmdebstrap") is None:
        pytest.skip(f"no base image {BASE} and no mmdebstrap to make one")
    tar = tmp / "debian.tar"
    sh("mmdebstrap", "--variant=minbase", "--include=ca-certificates", "bookworm", str(tar))
    sh("podman", "import", str(tar), BASE)
    return BASE


def build_context(tmp: Path) -> tuple[Path, list[str]]:
    """The files git knows (as a fresh clone has them), torch's local CPU wheel and the CA bundle, if any."""
    ctx = tmp / "context"
    files = sh("git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard").stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (ctx / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, ctx / name)
    args = []
    wheelhouse = ctx / "deploy/k8s/wheelhouse"
    wheelhouse.mkdir(parents=True, exist_ok=True)
    for wheel in Path("/opt/wheels").glob("torch-*+cpu-*.whl"):
        shutil.copy(wheel, wheelhouse)
    if CA_BUNDLE.is_file():
        shutil.copy(CA_BUNDLE, wheelhouse / "ca.crt")
        args += ["--build-arg", "CA_BUNDLE=/wheelhouse/ca.crt"]
    return ctx, args


def in_image(container: str, *argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return sh("buildah", "run", "--isolation", "chroot", "--network", "host", container, "--", *argv,
              timeout=timeout, check=False)  # fmt: skip


def test_the_image_builds_and_serves_a_cpu_deployment(tmp_path):
    base = base_image(tmp_path)
    ctx, args = build_context(tmp_path)
    isolation = ["--isolation", "chroot", "--network", "host", "--ulimit", "nofile=20000:20000"]
    build = sh("buildah", "build", *isolation, "--build-arg", f"BASE={base}", *args, "-t", IMAGE, "-f", "Containerfile",
               str(ctx), check=False)  # fmt: skip
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]

    podman = sh("podman", "run", "--rm", IMAGE, "--help", check=False, timeout=120)
    if podman.returncode != 0:
        print(f"podman run failed here ({podman.returncode}): {podman.stderr.strip()}; using buildah's chroot")
    container = sh("buildah", "from", IMAGE).stdout.strip()
    try:
        config = sh("buildah", "inspect", "--type", "image", IMAGE).stdout
        assert '"User": "10001:10001"' in config and '"zserve"' in config  # non-root, entrypoint zserve
        helped = in_image(container, "zserve", "--help")
        assert helped.returncode == 0 and "k8s" in helped.stdout, helped.stderr
        # A tiny CPU deployment inside the image: zserve up, one predict over HTTP, SIGTERM, exit 0.
        script = textwrap.dedent(
            """
            import json, signal, subprocess, urllib.request
            open("/tmp/echo.toml", "w").write('[frontends]\\nport = 18871\\nworkers = 1\\n'
                '[[models]]\\nname = "echo"\\nhandler = "zserve.models.echo:Echo"\\n')
            up = subprocess.Popen(["zserve", "up", "-c", "/tmp/echo.toml"], stdout=subprocess.PIPE, text=True)
            for line in up.stdout:
                if line.startswith("zserve ready"):
                    break
            body = urllib.request.urlopen(urllib.request.Request(
                "http://127.0.0.1:18871/v1/models/echo/predict", data=b'{"in": "image"}')).read()
            up.send_signal(signal.SIGTERM)
            up.stdout.read()
            print("ANSWER", body.decode(), "EXIT", up.wait())
            """
        )
        served = in_image(container, "python", "-c", script, timeout=300)
        assert 'ANSWER {"in":"image"} EXIT 0' in served.stdout, served.stdout[-3000:] + served.stderr[-3000:]
    finally:
        sh("buildah", "rm", container, check=False)
