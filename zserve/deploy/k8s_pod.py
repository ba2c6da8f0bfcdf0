"""What a pod of ``zserve k8s``'s manifests runs that the plain module commands do not.

``python -m zserve.deploy.k8s_pod frontend [--curve-key K --broker-key B] -- GUNICORN_ARGS``: gunicorn in this
process, after making every tcp socket its workers open authenticate with CURVE (``use_curve_for_tcp``;
the workers are forked from this process, and each builds its client after the fork) and after creating
what `zserve up` creates for the frontends: the run dir (for gunicorn's pid file) and an empty prometheus
multiprocess dir.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from zserve.keys import CurveKeys
from zserve.transport import use_curve_for_tcp


def frontend(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m zserve.deploy.k8s_pod frontend")
    parser.add_argument("--curve-key", default="", help="the frontends' NAME.key_secret")
    parser.add_argument("--broker-key", default="", help="the broker's public NAME.key")
    parser.add_argument("gunicorn_args", nargs=argparse.REMAINDER, help="-- then gunicorn's arguments")
    args = parser.parse_args(argv)
    gunicorn_args = args.gunicorn_args[1:] if args.gunicorn_args[:1] == ["--"] else args.gunicorn_args
    if args.curve_key:
        use_curve_for_tcp(CurveKeys.load(args.curve_key, args.broker_key))
    if "--pid" in gunicorn_args:
        Path(gunicorn_args[gunicorn_args.index("--pid") + 1]).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    metrics = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if metrics:
        shutil.rmtree(metrics, ignore_errors=True)  # a restarted container keeps its emptyDir
        Path(metrics).mkdir(mode=0o700, parents=True)
    from gunicorn.app.wsgiapp import run

    sys.argv = ["gunicorn", *gunicorn_args]
    run()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["frontend"]:
        print("usage: python -m zserve.deploy.k8s_pod frontend [--curve-key K --broker-key B] -- ARGS", file=sys.stderr)
        return 2
    return frontend(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
