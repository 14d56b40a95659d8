"""The request path's per-block leaves, timed alone, beside what their work costs in one C call.

    .venv/bin/python benchmarks/request_path_leaves.py
    PYTHONPATH=<checkout>:<checkout>/lab .venv/bin/python <checkout>/benchmarks/request_path_leaves.py   # another's

On an 8 KB prompt (128 blocks of 64 characters), best of ``--repeat`` runs of ``--number`` calls:
block hashing (``block_hashes``), the in-flight prefix table's add and remove of one prompt (a
replica with nothing else in flight) and of two prompts sharing half their blocks, and the
in-memory index's add of a prompt it holds (its LRU touched). Beside them, the floor a native
structure would approach: one xxh3 over the whole prompt, one 128-entry dict built in C. The
in-flight table is not public (``extproc.api``): its module, which imports nothing of the
router, is loaded from the checkout's file, as ``mypyc_leaves.py`` does.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import timeit
from pathlib import Path
from typing import Any

import xxhash

from extproc.api.sim import PrefixIndex, block_hashes, model_seed


def _inflight_module() -> Any:
    # The checkout whose router is imported (extproc/request/prefix.py is block_hashes' module).
    root = Path(inspect.getfile(block_hashes)).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("inflight_leaf", root / "extproc/fleet/cache/inflight.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    """Time each leaf and print one line of figures (microseconds a call)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--number", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=9)
    args = p.parse_args()
    text = ("gateway replica prefix cache session token " * 200)[:8192]
    seed = model_seed("m")
    hashes = block_hashes(text, seed, 64, 2048)
    half = len(hashes) // 2
    other = block_hashes(text[: half * 64] + "x" * (len(text) - half * 64), seed, 64, 2048)
    table = _inflight_module().InflightPrefixes()
    index = PrefixIndex(31_250)
    index.add("r0", hashes)
    data = text.encode()

    def one() -> None:
        table.add("r0", hashes)
        table.remove("r0", hashes)

    def overlapping() -> None:
        table.add("r0", hashes)
        table.add("r0", other)
        table.remove("r0", hashes)
        table.remove("r0", other)

    cases = {
        "block_hashes": lambda: block_hashes(text, seed, 64, 2048),
        "in-flight add+remove": one,
        "two overlapping add+remove": overlapping,
        "index add (held)": lambda: index.add("r0", hashes),
        "floor: one xxh3 over 8 KB": lambda: xxhash.xxh3_64_intdigest(data, seed),
        "floor: dict.fromkeys(128)": lambda: dict.fromkeys(hashes, 1),
    }
    figures = {
        name: min(timeit.repeat(f, number=args.number, repeat=args.repeat)) / args.number for name, f in cases.items()
    }
    print(f"{len(hashes)} blocks: " + ", ".join(f"{name} {t * 1e6:.1f} us" for name, t in figures.items()))


if __name__ == "__main__":
    main()
