"""What compiling the request path's pure modules with mypyc gives the whole in-process path, measured.

    .venv/bin/python benchmarks/mypyc_hot_path.py                 # build (~4-5 min here), then 3 rounds each
    .venv/bin/python benchmarks/mypyc_hot_path.py --rounds 5

Copies ``extproc/`` into a scratch directory, compiles the modules a request goes through there
with mypyc, unchanged (the core, the bookkeeping, the cache view, the store in memory, the
decision, the request's reading and hashing, the replicas' book, the plan, the answers' building:
:data:`MODULES`), and runs ``benchmarks/request_path_inprocess.py`` against the interpreted tree
and the compiled copy in turns, each in a fresh process, so that a shared machine's load falls on
both. Nothing of the repository is changed or built. Not compiled: modules with pydantic models
(mypyc's classes have no signature pydantic can read) and ``server/stream.py`` (an async generator,
which mypyc does not compile).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = (
    "bookkeeping.py",
    "cache/estimate.py",
    "cache/inflight.py",
    "cache/reuse.py",
    "cache/view.py",
    "core/admission.py",
    "core/charging.py",
    "core/effects.py",
    "core/outcome.py",
    "core/report.py",
    "core/request.py",
    "core/watching.py",
    "health/latency.py",
    "health/rates.py",
    "health/replicas.py",
    "health/sessions.py",
    "metering.py",
    "plan.py",
    "rebalance/ledger.py",
    "rebalance/rebalancer.py",
    "request/agent_hints.py",
    "request/classes.py",
    "request/conversation.py",
    "request/features.py",
    "request/objectives.py",
    "request/openai_body.py",
    "request/prefix.py",
    "request/session.py",
    "request/subset.py",
    "request/tenant.py",
    "router.py",
    "routing/*.py",
    "server/envoy_messages.py",
    "state/conversations.py",
    "state/memory.py",
    "usage.py",
)
"""Paths under ``extproc/`` (globs allowed: a module split in two stays covered); ``__init__.py``
and modules that define pydantic models are left interpreted."""
FIGURE = re.compile(r"best (\d+) us/request")


def modules(tree: Path) -> list[str]:
    """The files of :data:`MODULES` in ``tree`` (relative to it) that mypyc can compile."""
    out: set[str] = set()
    for pattern in MODULES:
        for path in (tree / "extproc").glob(pattern):
            text = path.read_text()
            if path.name != "__init__.py" and "pydantic" not in text:
                out.add(str(path.relative_to(tree)))
    return sorted(out)


def build(tree: Path) -> None:
    """Copy ``extproc/`` into ``tree`` and compile :func:`modules` there in place."""
    mypyc = shutil.which("mypyc", path=str(Path(sys.executable).parent))
    if mypyc is None or shutil.which("gcc") is None:
        raise SystemExit("needs mypyc (the dev extra's mypy) and gcc")
    shutil.copytree(ROOT / "extproc", tree / "extproc", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copyfile(ROOT / "pyproject.toml", tree / "pyproject.toml")
    files = modules(tree)
    print(f"compiling {len(files)} modules with mypyc ...", flush=True)
    done = subprocess.run([mypyc, *files], check=False, cwd=tree, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"mypyc failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def figure(tree: Path, requests: int) -> int:
    """The in-process path's best figure (us a request) with ``tree``'s ``extproc`` first on the path."""
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{ROOT / 'lab'}"}
    argv = [sys.executable, str(ROOT / "benchmarks/request_path_inprocess.py"), "--requests", str(requests)]
    out = subprocess.run(argv, cwd=tempfile.gettempdir(), env=env, check=True, capture_output=True, text=True)
    found = FIGURE.search(out.stdout)
    if found is None:
        raise SystemExit(f"no figure in: {out.stdout}")
    return int(found.group(1))


def main() -> None:
    """Build the compiled copy, then time both in turns."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=2000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="extproc-mypyc-") as tmp:
        compiled = Path(tmp)
        build(compiled)
        figures: dict[str, list[int]] = {"interpreted": [], "mypyc": []}
        for _ in range(args.rounds):
            figures["interpreted"].append(figure(ROOT, args.requests))
            figures["mypyc"].append(figure(compiled, args.requests))
        for name, values in figures.items():
            print(f"{name}: best {min(values)} us/request (runs: {', '.join(map(str, values))})")


if __name__ == "__main__":
    main()
