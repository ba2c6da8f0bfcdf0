"""The ``zserve`` command."""

from __future__ import annotations

import argparse
import sys

from zserve.config import Config, ConfigError, endpoints_for, load_config, run_dir_for


def _load(path: str) -> Config | None:
    try:
        return load_config(path)
    except ConfigError as exc:
        print(f"zserve: {exc}", file=sys.stderr)
        return None


def _up(args: argparse.Namespace) -> int:
    from zserve.logs import setup_logging
    from zserve.supervisor import Supervisor

    config = _load(args.config)
    if config is None:
        return 2
    if args.port is not None:
        config.frontends.port = args.port
    if args.host is not None:
        config.frontends.host = args.host
    setup_logging("supervisor", args.log_level)
    try:
        supervisor = Supervisor(config, args.config)
    except ConfigError as exc:
        print(f"zserve: {exc}", file=sys.stderr)
        return 2
    return supervisor.run()


def _check(args: argparse.Namespace) -> int:
    config = _load(args.config)
    if config is None:
        return 2
    run_dir = run_dir_for(config, args.config)
    print(f"{args.config}: ok; {len(config.models)} model(s): {', '.join(m.name for m in config.models)}")
    print(f"run dir {run_dir}; broker client endpoint {endpoints_for(config, run_dir).client}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zserve", description="High-throughput model serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser(
        "up",
        help="start a deployment: broker, engines, REST frontends",
        description="Start the broker, the engines of every [[models]] table and (once every engine is ready) "
        "the gunicorn frontends; print 'zserve ready: http://HOST:PORT' when /readyz answers 200. Restarts "
        "crashed processes with backoff; SIGTERM or Ctrl-C stops everything in order and exits 0.",
    )
    up.add_argument("-c", "--config", default="supervisor.toml", help="the deployment file (default: %(default)s)")
    up.add_argument("--host", default=None, help="override [frontends] host")
    up.add_argument("--port", type=int, default=None, help="override [frontends] port")
    up.add_argument("--log-level", default=None, help="DEBUG, INFO (default, or $ZSERVE_LOG_LEVEL), WARNING, ERROR")
    up.set_defaults(func=_up)

    check = sub.add_parser("check", help="validate a deployment file and print where its broker listens")
    check.add_argument("-c", "--config", default="supervisor.toml", help="the deployment file (default: %(default)s)")
    check.set_defaults(func=_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
