"""Benchmarks have one home: ``benchmarks/``. Each benchmark is a script there or an ``extproc bench``
command, and its results are recorded in a page there that names it; the lab's ``bench/`` holds
the procedures they share (workloads, the routers started, the reductions), not results."""

from __future__ import annotations

import argparse

from extproc_lab.bench import cli as bench_cli
from tests.conftest import ROOT

BENCHMARKS = ROOT / "benchmarks"


def _pages() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted(BENCHMARKS.glob("*.md")))


def test_every_benchmark_script_has_its_results_in_a_page_beside_it() -> None:
    pages = _pages()
    scripts = sorted(p.name for p in BENCHMARKS.glob("*.py"))
    assert scripts
    assert [s for s in scripts if f"benchmarks/{s}" not in pages and s not in pages] == []


def test_every_bench_command_has_its_results_in_benchmarks() -> None:
    bench = bench_cli.add_bench_parser(argparse.ArgumentParser().add_subparsers())
    (kinds,) = [a for a in bench._actions if isinstance(a, argparse._SubParsersAction)]
    commands = sorted(kinds.choices)
    assert commands
    pages = _pages()
    assert [c for c in commands if f"extproc bench {c}" not in pages] == []
    # No results kept in the lab.
    assert sorted(p.name for p in (ROOT / "lab").rglob("*.md") if "bench" in p.parts) == []
