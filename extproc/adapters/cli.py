"""The ``extproc`` command line: serve, envoy-config, check-config, admin, calibrate.

Installed packages add sub-commands through the ``extproc.commands`` entry point group (a
function given the sub-parsers, setting ``run`` on each parser it adds): the lab adds ``replica``,
``demo`` and ``bench``. What ``serve`` runs is :mod:`extproc.adapters.server.serving`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points

from extproc import __version__
from extproc.base import event_loop
from extproc.base.logs import setup_logging
from extproc.config import ConfigError, load_config
from extproc.config import picker_invocation as picker
from extproc.config.cli_flags import add_config_flags, config_from_flags, env_name

COMMANDS_GROUP = "extproc.commands"
LOG_FORMATS = ("text", "json")


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="run the ext_proc routing server",
        usage="extproc serve [--config FILE] [--KEY VALUE ...]",
        description="Every key of the config file is a flag and an EXTPROC_ variable (docs/environment-variables.md).",
    )
    # These three are no keys of the file; their variables are their defaults.
    env = os.environ
    p.add_argument(
        "--config",
        default=env.get(env_name("--config")) or None,
        help=f"YAML config file (flags below override it) [env {env_name('--config')}]",
    )
    p.add_argument(
        "--log-level",
        default=env.get(env_name("--log-level")) or "info",
        help=f"debug, info, warning or error [env {env_name('--log-level')}]",
    )
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=env.get(env_name("--log-format")) or "text",
        help=f"text or json [env {env_name('--log-format')}]",
    )
    add_config_flags(p)
    picker.add_picker_flags(p)


def _envoy_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # Scenario and output names are checked by extproc.adapters.envoy_config, imported only for this command.
    p = sub.add_parser(
        "envoy-config", help="render an Envoy bootstrap (or Istio EnvoyFilter) for the router's replicas"
    )
    p.add_argument("--config", help="router YAML config (replicas or discovery, mode, headers, listen)")
    p.add_argument(
        "--scenario",
        help="a preset, as the folders of envoy/: cluster-mode, endpoint-mode, endpoint-original-dst, failover, "
        "unix-socket, kubernetes",
    )
    p.add_argument(
        "--output",
        default="bootstrap",
        help="bootstrap (default), istio-envoyfilter, or istio-header-strip (the strip alone, for a GIE gateway)",
    )
    p.add_argument("--replica", action="append", default=[], metavar="NAME=HOST:PORT")
    p.add_argument("--mode", choices=["cluster", "endpoint"])
    p.add_argument("--processor", help="the processor's HOST:PORT or unix:/path (default: the config's listen)")
    p.add_argument("--listen", help="the gateway listener (default 127.0.0.1:10000)")
    p.add_argument("--admin", help="the admin interface (default 127.0.0.1:9901)")
    p.add_argument("--round-robin-listen", help="also a plain round-robin listener here")
    p.add_argument(
        "--endpoint-cluster",
        choices=["override_host", "original_dst"],
        help="endpoint mode: a cluster of known replicas with failover (override_host, default), or ORIGINAL_DST",
    )
    p.add_argument("--health-check-path", help="active HTTP health checks of the replicas on this path")
    p.add_argument("--probe-listen", help="a listener exposing only the admin's /ready and /stats/prometheus")
    p.add_argument("--replicas-dns", metavar="HOST:PORT", help="endpoint mode: replicas by DNS (default: discovery)")
    p.add_argument("--istio-namespace", default="istio-system", help="istio-envoyfilter: the gateway's namespace")
    p.add_argument(
        "--istio-gateway",
        metavar="NAME",
        help="istio-header-strip: the Gateway API Gateway whose pods it applies to (default: Istio's ingress gateway)",
    )
    p.add_argument("--processor-ca", metavar="FILE", help="TLS to the processor: the CA of its certificate")
    p.add_argument("--processor-cert", metavar="FILE", help="mTLS: Envoy's client certificate for the processor")
    p.add_argument("--processor-key", metavar="FILE", help="mTLS: the key of --processor-cert")
    p.add_argument("--processor-server-name", metavar="NAME", help="TLS: SNI and the SAN the processor must have")
    p.add_argument(
        "--tracing-collector", metavar="HOST:PORT", help="Envoy's own spans to this OTLP/gRPC collector (plaintext)"
    )
    p.add_argument(
        "--tracing-sample-percent",
        type=float,
        metavar="PERCENT",
        help="share of requests without a sampled traceparent Envoy traces (default: the config's tracing.sample_rate)",
    )
    p.add_argument(
        "--access-log",
        metavar="PATH",
        help="Envoy's access log (a file, or /dev/stdout): a JSON line a request, the processor's time by message",
    )


def _check_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("check-config", help="validate a router config file without starting (exit 2 if invalid)")
    p.add_argument("file", help="router YAML config")


def build_parser() -> argparse.ArgumentParser:
    """The ``extproc`` command line: the router's commands, and those of installed plugins (the lab's)."""
    parser = argparse.ArgumentParser(prog="extproc", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _envoy_parser(sub)
    _check_parser(sub)
    from extproc.adapters.admin.client import add_parser as _admin_parser

    _admin_parser(sub)
    from extproc.adapters.calibrate import add_parser as _calibrate_parser

    _calibrate_parser(sub)
    for entry in entry_points(group=COMMANDS_GROUP):
        try:
            register = entry.load()
        except ImportError as exc:  # a plugin half-installed must not take the router's commands down
            print(f"extproc: sub-commands {entry.value!r} not loaded: {exc}", file=sys.stderr)
            continue
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``extproc`` console script."""
    parser = build_parser()
    argv, args = picker.parse_command_line(parser, sys.argv[1:] if argv is None else argv)  # GIE's picker's start too
    if getattr(args, "log_format", "text") not in LOG_FORMATS:  # argparse checks a flag, not its variable
        parser.error(f"{env_name('--log-format')}: expected one of {', '.join(LOG_FORMATS)}, got {args.log_format!r}")
    quiet = args.command in ("demo", "bench", "admin", "calibrate")
    setup_logging(getattr(args, "log_level", "warning" if quiet else "info"), getattr(args, "log_format", "text"))
    try:
        if args.command == "serve":
            picker.report_picker_flags(args)
            cfg = config_from_flags(args.config, args)
            if not cfg.replicas and cfg.discovery.is_static:
                parser.error(
                    "serve: no replicas (give --replica NAME=HOST:PORT, or a config file with replicas or discovery)"
                )
            from extproc.adapters.server.listeners import BindError
            from extproc.adapters.server.serving import serve, serve_worker

            try:
                if cfg.workers > 1:
                    from extproc.adapters.server.workers import check_workers, supervise

                    problem = check_workers(cfg)
                    if problem is not None:
                        raise ConfigError(problem)
                    return supervise(cfg, serve_worker, argv)
                event_loop.run(serve(cfg))
            except BindError as exc:
                # Nothing was reported SERVING: a port in use stops the start, naming the address.
                print(f"extproc: {exc}", file=sys.stderr)
                return 3
        elif args.command == "envoy-config":
            from extproc.adapters.envoy_config import run_envoy_config

            return run_envoy_config(args, sys.stdout)
        elif args.command == "calibrate":
            from extproc.adapters.calibrate import run as run_calibrate

            return run_calibrate(args)
        elif args.command == "check-config":
            cfg = load_config(args.file)
            print(f"{args.file}: ok (mode {cfg.mode}, {len(cfg.replicas)} replicas, discovery {cfg.discovery.type})")
        else:
            run: Callable[[argparse.Namespace], int] = args.run
            return run(args)
    except ConfigError as exc:
        print(f"extproc: config error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
