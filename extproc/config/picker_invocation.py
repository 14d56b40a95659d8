"""The router started as GIE's endpoint picker is started: ``extproc --pool-name NAME ...``.

GIE's ``inferencepool`` chart runs its picker image with the picker's flags and no command, so
with our image in its place the ``extproc`` entry point receives ``--pool-name NAME --pool-namespace
NS --pool-group ... --zap-encoder json --config-file /config/...``. Such a command line (one that
starts with a flag other than ``--help`` or ``--version``) is ``serve`` in endpoint mode (GIE's
protocol) with GIE's picker's ports:
ext_proc on 9002, plaintext gRPC health on 9003 and metrics on 9090, every interface (the ports
GIE's chart's Service and probes name). Its flags that mean the same here are the router's own
(``--pool-name``, ``--grpc-port``, ``--cert-path``, ``--secure-serving``, ...); the few that have no
meaning here are accepted and said so at start rather than refused, so the chart runs unchanged;
any other flag is refused by name.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from extproc.config.errors import ConfigError

POOL_GROUP = "inference.networking.k8s.io"
# GIE's protocol (endpoint mode) and its picker's ports; a flag given after them wins.
PICKER_DEFAULTS = ("--mode", "endpoint", "--grpc-port", "9002", "--grpc-health-port", "9003", "--metrics-port", "9090")
log = logging.getLogger("extproc.config")
# The picker's flags accepted and reported, changing nothing (their attributes).
_MEANINGLESS = ("config_file", "config_text", "ha_enable_leader_election", "tracing", "metrics_endpoint_auth")


def as_serve(argv: Sequence[str]) -> list[str]:
    """``argv`` as the router's command line: a picker's flags with no command are ``serve`` in
    endpoint mode with the picker's ports (any such flag given after them wins)."""
    if argv and argv[0].startswith("--") and argv[0] not in ("--help", "--version"):
        return ["serve", *PICKER_DEFAULTS, *argv]
    return list(argv)


def add_picker_flags(parser: argparse.ArgumentParser) -> None:
    """GIE's picker's flags that mean nothing here (or only a log format)."""
    group = parser.add_argument_group("GIE's picker's flags with no meaning here (accepted, reported at start)")
    group.add_argument(
        "--pool-group", metavar="GROUP", help=f"the pool's API group: only {POOL_GROUP} (v1) is followed"
    )
    group.add_argument("--zap-encoder", choices=("json", "console"), help="json: --log-format json; console: text")
    group.add_argument("--v", type=int, metavar="N", help="verbosity: 4 or more is --log-level debug")
    group.add_argument("--config-file", metavar="FILE", help="GIE's plugins file: ignored (the router's is --config)")
    group.add_argument("--config-text", metavar="YAML", help="GIE's plugins text: ignored")
    group.add_argument(
        "--ha-enable-leader-election",
        nargs="?",
        const="true",
        metavar="BOOL",
        help="ignored: every replica picks; share state with --store redis://...",
    )
    group.add_argument("--tracing", metavar="BOOL", help="ignored: tracing is --tracing-endpoint")
    group.add_argument("--metrics-endpoint-auth", metavar="BOOL", help="ignored: /metrics has no authentication")


def parse_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[list[str], argparse.Namespace]:
    """``argv`` as the router's command line (:func:`as_serve`) and its parsed arguments with the
    picker's flags folded in; a pool group not followed exits 2, as any config error does."""
    argv = as_serve(argv)
    args = parser.parse_args(argv)
    try:
        apply_picker_flags(args)
    except ConfigError as exc:
        parser.exit(2, f"extproc: config error: {exc}\n")
    return argv, args


def apply_picker_flags(args: argparse.Namespace) -> None:
    """Fold the picker's flags into ``args`` (log format and level), refuse a pool group that is
    not followed, and log each flag ignored."""
    group = getattr(args, "pool_group", None)
    if group is not None and group != POOL_GROUP:
        raise ConfigError(f"--pool-group: only {POOL_GROUP} InferencePools (v1) are followed, got {group!r}")
    encoder = getattr(args, "zap_encoder", None)
    if encoder is not None:
        args.log_format = "json" if encoder == "json" else "text"
    verbosity = getattr(args, "v", None)
    if verbosity is not None and verbosity >= 4:
        args.log_level = "debug"


def report_picker_flags(args: argparse.Namespace) -> None:
    """Log the picker's flags given that change nothing here (once logging is set up)."""
    for flag in _MEANINGLESS:
        value = getattr(args, flag, None)
        if value is not None:
            log.warning("--%s=%s: a flag of GIE's picker with no meaning here, ignored", flag.replace("_", "-"), value)
