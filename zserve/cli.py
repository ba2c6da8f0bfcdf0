"""The ``zserve`` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zserve.config import Config, ConfigError, endpoints_for, load_config, run_dir_for


def _load(path: str) -> Config | None:
    try:
        return load_config(path)
    except ConfigError as exc:
        print(f"zserve: {exc}", file=sys.stderr)
        return None


def _up(args: argparse.Namespace) -> int:
    config = _load(args.config)
    if config is None:
        return 2
    if args.port is not None:
        config.frontends.port = args.port
    if args.host is not None:
        config.frontends.host = args.host
    return _supervise(config, args.config, args.log_level)


def _supervise(config: Config, config_path: str, log_level: str | None) -> int:
    """Run ``config``'s deployment in the foreground until it is stopped (``zserve up`` and ``serve``)."""
    from zserve.deploy.plan import plan
    from zserve.deploy.supervisor import Supervisor
    from zserve.devices import check_devices
    from zserve.keys import check_broker_keys
    from zserve.logs import setup_logging

    setup_logging("supervisor", log_level)
    try:
        check_devices(config.models)  # this host runs the engines: every cuda:N must be here
        b = config.broker
        if any(b.remote_endpoints()) and not b.insecure:
            check_broker_keys(b.curve_key, b.authorized_keys_dir)
        supervisor = Supervisor(plan(config, config_path))
    except ConfigError as exc:
        print(f"zserve: {exc}", file=sys.stderr)
        return 2
    return supervisor.run()


def _serve(args: argparse.Namespace) -> int:
    import shutil
    import tempfile

    from zserve.config import to_toml
    from zserve.deploy.quickstart import parse_option, serve_config

    try:
        options = dict(parse_option(o) for o in args.option)
        config = serve_config(
            args.model, args.task, name=args.name, host=args.host, port=args.port, workers=args.workers,
            engines=args.engines, threads=args.threads, max_batch_size=args.max_batch_size, options=options,
        )  # fmt: skip
        text = to_toml(config)
    except (ConfigError, ValueError) as exc:
        print(f"zserve: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(f"# zserve serve {' '.join(sys.argv[2:])}\n# run it with: zserve up -c FILE\n{text}")
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="zserve-serve-"))
    try:
        path = workdir / "supervisor.toml"
        path.write_text(text)
        model = config.models[0]
        print(f"zserve serve: {model.name} with {model.handler} (the deployment file: --print-config)", flush=True)
        return _supervise(config, str(path), args.log_level)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _check(args: argparse.Namespace) -> int:
    config = _load(args.config)
    if config is None:
        return 2
    run_dir = run_dir_for(config, args.config)
    print(f"{args.config}: ok; {len(config.models)} model(s): {', '.join(m.name for m in config.models)}")
    print(f"run dir {run_dir}; broker client endpoint {endpoints_for(config, run_dir).client}")
    return 0


def _supervisord_conf(args: argparse.Namespace) -> int:
    from zserve.deploy.supervisord import render

    config = _load(args.config)
    if config is None:
        return 2
    config_path = Path(args.config).resolve()
    state_dir = Path(args.dir) if args.dir else config_path.parent / "supervisord"
    try:
        text = render(config, config_path, state_dir, args.group)
    except ConfigError as exc:
        print(f"zserve: {exc}", file=sys.stderr)
        return 2
    state_dir.mkdir(parents=True, exist_ok=True)  # supervisord creates neither its socket's nor its logs' dir
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}; start it with: supervisord -c {args.output}", file=sys.stderr)
    return 0


def _k8s(args: argparse.Namespace) -> int:
    import yaml

    from zserve.deploy.k8s import RenderOptions, header, pod_plan, render

    config = _load(args.config)
    if config is None:
        return 2
    opts = RenderOptions(
        image=args.image, name=args.name, namespace=args.namespace, prometheus=args.prometheus,
        max_engines_factor=args.max_engines_factor, max_frontends=args.max_frontends, models_pvc=args.models_pvc,
    )  # fmt: skip
    try:
        manifests = render(pod_plan(config, opts), opts)
    except ConfigError as exc:
        print(f"zserve: {exc}", file=sys.stderr)
        return 2

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: object) -> bool:
            return True  # spell every repeated label set out: kubectl users read these files

    def dump(manifest: dict) -> str:
        return yaml.dump(manifest, Dumper=Dumper, sort_keys=False, width=1 << 16)

    if args.output in (None, "-"):
        sys.stdout.write(header(opts) + "".join(f"---\n{dump(m)}" for m in manifests))
        return 0
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    for i, m in enumerate(manifests):
        (out / f"{i:02d}-{m['kind'].lower()}-{m['metadata']['name']}.yaml").write_text(header(opts) + dump(m))
    print(f"wrote {len(manifests)} manifests to {out}; read a header before: kubectl apply -f {out}", file=sys.stderr)
    return 0


def _child(args: argparse.Namespace) -> int:
    from zserve.deploy.supervisord import exec_child
    from zserve.logs import setup_logging

    config = _load(args.config)
    if config is None:
        return 2
    setup_logging(args.name)
    try:
        return exec_child(config, args.config, args.name)
    except ConfigError as exc:
        print(f"zserve: {exc}", file=sys.stderr)
        return 2


def _status(args: argparse.Namespace) -> int:
    from zserve.deploy.status import status

    config = _load(args.config)
    if config is None:
        return 2
    try:
        return status(config, args.config, sys.stdout, timeout_s=args.timeout)
    except ConfigError as exc:
        print(f"zserve: {exc}", file=sys.stderr)
        return 2


def _keys(args: argparse.Namespace) -> int:
    from zserve.keys import generate

    try:
        public, secret = generate(args.dir, args.name)
    except (FileExistsError, OSError) as exc:
        print(f"zserve: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {public} (public: copy it into the broker's authorized_keys_dir, or to the parties) and {secret}")
    return 0


def _workers(args: argparse.Namespace) -> int:
    from zserve.deploy.supervisor import Supervisor
    from zserve.deploy.worker_host import load_workers_config, worker_host_plan
    from zserve.logs import setup_logging

    setup_logging("supervisor", args.log_level)
    try:
        host = Supervisor(worker_host_plan(load_workers_config(args.config), args.config))
    except ConfigError as exc:
        print(f"zserve: {exc}", file=sys.stderr)
        return 2
    return host.run()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zserve", description="High-throughput model serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser(
        "up",
        help="start a deployment: broker, stages and engines, REST frontends",
        description="Start the broker, the preprocess stages and engines of every [[models]] table and (once every "
        "engine and stage is ready) the gunicorn frontends; print 'zserve ready: http://HOST:PORT' when /readyz "
        "answers 200. Restarts crashed processes with backoff; SIGTERM or Ctrl-C stops everything in order and exits "
        "0.",
    )
    up.add_argument("-c", "--config", default="supervisor.toml", help="the deployment file (default: %(default)s)")
    up.add_argument("--host", default=None, help="override [frontends] host")
    up.add_argument("--port", type=int, default=None, help="override [frontends] port")
    up.add_argument("--log-level", default=None, help="DEBUG, INFO (default, or $ZSERVE_LOG_LEVEL), WARNING, ERROR")
    up.set_defaults(func=_up)

    serve = sub.add_parser(
        "serve",
        help="serve one model folder without a config file (the task read from its config.json)",
        description="Start a one-model deployment for MODEL (a folder saved with save_pretrained, or a hub name "
        "where a hub is reachable) with the built-in handler of its task: embed (sentence embeddings), classify "
        "(sequence classification), rerank (a cross-encoder: /v1/rerank, /v1/score), image-classify, generate "
        "(a causal LM: /v1/completions, /v1/chat/completions). --print-config prints the equivalent "
        "supervisor.toml for `zserve up -c`.",
    )
    serve.add_argument("model", help="a from_pretrained folder (or a hub name)")
    serve.add_argument("--task", default=None, choices=["embed", "classify", "rerank", "image-classify", "generate"],
                       help="default: read from the model's config.json")  # fmt: skip
    serve.add_argument("--name", default=None, help="the model's name in routes (default: the folder's name)")
    serve.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    serve.add_argument("--workers", type=int, default=0,
                       help="frontend worker processes (default: 0 = half the CPU cores, at least 1)")  # fmt: skip
    serve.add_argument("--engines", type=int, default=1, help="engine processes (default: %(default)s)")
    serve.add_argument("--threads", type=int, default=None, help="torch threads per engine (default: cores / engines)")
    serve.add_argument("--max-batch-size", type=int, default=32, help="(default: %(default)s)")
    serve.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                       help="a handler option ([models.options]), e.g. -o max_length=256; repeatable")  # fmt: skip
    serve.add_argument("--print-config", action="store_true", help="print the supervisor.toml and exit")
    serve.add_argument("--log-level", default=None)
    serve.set_defaults(func=_serve)

    check = sub.add_parser("check", help="validate a deployment file and print where its broker listens")
    check.add_argument("-c", "--config", default="supervisor.toml", help="the deployment file (default: %(default)s)")
    check.set_defaults(func=_check)

    conf = sub.add_parser(
        "supervisord-conf",
        help="render a supervisord configuration for a deployment",
        description="Print (or write with -o) a supervisord configuration: one program per broker, stage, engine "
        "and frontend server, in one group, each started with `zserve child`. Run it with `supervisord -c FILE`.",
    )
    conf.add_argument("-c", "--config", default="supervisor.toml", help="the deployment file (default: %(default)s)")
    conf.add_argument("-o", "--output", default=None, help="write here instead of standard output")
    conf.add_argument(
        "--dir", default=None, help="supervisord's socket, pid file and logs (default: supervisord/ next to -c)"
    )
    conf.add_argument("--group", default="zserve", help="the supervisord group name (default: %(default)s)")
    conf.set_defaults(func=_supervisord_conf)

    k8s = sub.add_parser(
        "k8s",
        help="render Kubernetes manifests for a deployment",
        description="Print (or write one file per object into -o DIR) Kubernetes manifests for the deployment: "
        "the config as a ConfigMap, the broker (one replica, Recreate) and its Service, per model a Deployment of "
        "engines (GPUs from devices, CPU from threads) with a KEDA ScaledObject on the broker's queue, one of "
        "stages, the frontends with a Service and an HPA, PodDisruptionBudgets. See docs/kubernetes.md.",
    )
    k8s.add_argument("-c", "--config", default="supervisor.toml", help="the deployment file (default: %(default)s)")
    k8s.add_argument("-o", "--output", default=None, help="a directory for the manifests (default: standard output)")
    k8s.add_argument("--image", default="zserve:latest", help="the container image (default: %(default)s)")
    k8s.add_argument("--name", default="zserve", help="prefix of every object's name (default: %(default)s)")
    k8s.add_argument("--namespace", default="", help="metadata.namespace (default: none, kubectl's)")
    k8s.add_argument("--prometheus", default="http://prometheus-server.monitoring.svc:80",
                     help="the Prometheus KEDA queries for queue depth (default: %(default)s)")  # fmt: skip
    k8s.add_argument("--max-engines-factor", type=int, default=4,
                     help="engines (KEDA), stages (HPA): up to this x configured (default: %(default)s)")  # fmt: skip
    k8s.add_argument("--max-frontends", type=int, default=8, help="the frontends' HPA ceiling (default: %(default)s)")
    k8s.add_argument("--models-pvc", default="",
                     help="a PersistentVolumeClaim with model weights, mounted read-only at /models")  # fmt: skip
    k8s.set_defaults(func=_k8s)

    child = sub.add_parser(
        "child",
        help="run one process of a deployment (what supervisord-conf's programs run)",
        description="Build the command line of process NAME (broker, engine-MODEL-I, stage-MODEL-I, frontend) as "
        "`zserve up` would and exec it. The frontend first waits until every engine and stage has registered.",
    )
    child.add_argument("-c", "--config", default="supervisor.toml", help="the deployment file (default: %(default)s)")
    child.add_argument("name", help="broker, engine-MODEL-I, stage-MODEL-I or frontend")
    child.set_defaults(func=_child)

    st = sub.add_parser(
        "status",
        help="show a running deployment; exit 0 when every model is ready",
        description="Print the processes (under `zserve up`) and, per model, engines, queue, credits, batch size, "
        "latency percentiles and, for generative models, running sequences and KV use. Exit 0 when every model "
        "is ready, 1 otherwise.",
    )
    st.add_argument("-c", "--config", default="supervisor.toml", help="the deployment file (default: %(default)s)")
    st.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the broker (default: %(default)s)")
    st.set_defaults(func=_status)

    keys = sub.add_parser("keys", help="CURVE key pairs for tcp endpoints")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    gen = keys_sub.add_parser("generate", help="write DIR/NAME.key (public) and DIR/NAME.key_secret")
    gen.add_argument("dir")
    gen.add_argument("--name", default="broker", help="the key pair's name (default: %(default)s)")
    gen.set_defaults(func=_keys)

    workers = sub.add_parser(
        "workers",
        help="a worker host: engines and stages that join a broker on another host",
        description="Start the engines and stages of workers.toml's [[models]], connected to the remote broker of "
        "its [broker] table over tcp (CURVE), supervised like `zserve up` (restarts, backoff, giving up loudly).",
    )
    workers.add_argument("-c", "--config", default="workers.toml", help="(default: %(default)s)")
    workers.add_argument("--log-level", default=None)
    workers.set_defaults(func=_workers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
