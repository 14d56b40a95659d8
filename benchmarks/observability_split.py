"""Does a second, observability-mode ext_proc filter cost less than the third message a request?

    .venv/bin/python benchmarks/observability_split.py --rounds 3 --seconds 6

Envoy 1.40's ``observability_mode`` is a property of the whole filter (``ext_proc.cc``:
``onReceiveMessage`` drops every answer when it is on), so a router cannot take it for the response
alone: it would need a second ext_proc filter, observing, beside the routing one. This measures
that shape against the real Envoy with the do-nothing processor
(:mod:`extproc_lab.bench.bare_processor`), three Envoy configurations in rounds (setup as
``extproc bench overhead``'s, 8 KB prompts, 16 connections):

- ``three``: the rendered config: request headers, body and response headers on one stream;
- ``two``: the same with ``response_header_mode: SKIP`` (the floor: nothing learnt from responses);
- ``two+observer``: ``two``, plus a second ext_proc filter in observability mode that sends the
  response headers on a stream of its own and does not wait for an answer.

Prints each configuration's median requests/s and CPU per request (processor, Envoy).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from extproc_lab.bench.overhead import Wrk, cpu_seconds, rounds_table, swap_in_bare_processor
from extproc_lab.demo.gateway import LocalGateway

ROUTER_FILTER = "          - name: envoy.filters.http.router\n"
OBSERVER = """\
          - name: envoy.filters.http.ext_proc.observer
            typed_config:
              '@type': type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc:
                  cluster_name: extproc
              failure_mode_allow: true
              observability_mode: true
              deferred_close_timeout: 1s
              processing_mode:
                request_header_mode: SKIP
                response_header_mode: SEND
                request_body_mode: NONE
                response_body_mode: NONE
                request_trailer_mode: SKIP
                response_trailer_mode: SKIP
"""


def skip_response(yaml: str) -> str:
    """The routing filter without the response headers."""
    return yaml.replace("response_header_mode: SEND", "response_header_mode: SKIP", 1)


def with_observer(yaml: str) -> str:
    """``skip_response``, plus the observing filter before the router."""
    edited = skip_response(yaml)
    if ROUTER_FILTER not in edited:
        raise SystemExit("the rendered config's router filter was not found")
    return edited.replace(ROUTER_FILTER, OBSERVER + ROUTER_FILTER, 1)


CONFIGS: dict[str, Callable[[str], str] | None] = {"three": None, "two": skip_response, "two+observer": with_observer}


def main() -> None:
    """Measure each Envoy configuration in rounds and print a Markdown table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--prompt-kb", type=int, default=8)
    p.add_argument("--connections", type=int, default=16)
    args = p.parse_args()
    wrk_bin = shutil.which("wrk")
    if wrk_bin is None:
        raise SystemExit("needs wrk (Debian package wrk)")
    runs: dict[str, list[tuple[float, float, float]]] = {c: [] for c in CONFIGS}
    with (
        tempfile.TemporaryDirectory(prefix="extproc-observer-") as tmp,
        LocalGateway(replicas=2, profile="instant") as gw,
    ):
        wrk = Wrk(wrk_bin, Path(tmp))
        url = swap_in_bare_processor(gw)
        bare = gw.procs.procs["bare_extproc"].pid
        for _ in range(args.rounds):
            for name, edit in CONFIGS.items():
                gw.procs.stop("envoy")
                gw.envoy_yaml_edit = edit
                gw.start_envoy()
                wrk.run(url, args.prompt_kb, args.connections, 2)  # warm up
                envoy = gw.procs.procs["envoy"].pid
                before = cpu_seconds(bare), cpu_seconds(envoy)
                top = wrk.run(url, args.prompt_kb, args.connections, args.seconds)
                after = cpu_seconds(bare), cpu_seconds(envoy)
                n = top["requests"] or 1
                row = (top["rps"], (after[0] - before[0]) / n * 1e6, (after[1] - before[1]) / n * 1e6)
                runs[name].append(row)
                print(f"{name}: {row} errors {top['errors']}", file=sys.stderr)
    print(f"{args.prompt_kb} KB prompts, {args.connections} connections, {args.seconds:g} s a run, "
          f"{args.rounds} rounds; medians (and the range over the rounds)\n")  # fmt: skip
    print(rounds_table("Envoy configuration", runs))


if __name__ == "__main__":
    main()
