"""Our policy re-run against the committed routing tables, at their seeds: what a routing change
moved, figure by figure (the peers' rows do not depend on our code, so only ours is re-run).

For each table in ``benchmarks/routing/`` (the main ones and every level of the KV-pressure sweeps)
``extproc bench routing --policies extproc`` runs with the table's own workload, seed, rate, KV
size and config; one Markdown table lists the committed and the new hit ratio, TTFT p99 and share
of sticky turns kept, beside the best peer of the committed table.

    .venv/bin/python benchmarks/ours_against_committed.py [--only NAME,...] [--out FILE]
    .venv/bin/python benchmarks/ours_against_committed.py --variant benchmarks/routing/price.yaml

With ``--variant FILE`` the new row is that router config's ``profile:`` (the table's other
settings kept), run as ``extproc bench routing --variant``: a profile measured against our
committed rows before it becomes the default.

About 15 minutes on this 2-core machine for all of them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROUTING = Path(__file__).resolve().parent / "routing"
PEERS = ("sglang_cache_aware", "gie_default", "consistent_hash", "round_robin")


def runs() -> list[tuple[str, dict[str, Any]]]:
    """(label, committed table) for every table and sweep level."""
    found = []
    for path in sorted(ROUTING.glob("*.json")):
        data = json.loads(path.read_text())
        for table in data.get("levels", [data]):
            label = path.stem if "levels" not in data else f"{path.stem}@{table['kv_blocks']}"
            found.append((label, table))
    return found


VARIANT = "variant"


def rerun(table: dict[str, Any], out: Path, variant: Path | None = None) -> dict[str, Any]:
    """Our row of ``table``, simulated again with this checkout (with ``variant``'s profile, if given)."""
    setup, workload = table["setup"], table["workload"]
    policy = VARIANT if variant is not None else "extproc"
    cmd = [sys.executable, "-m", "extproc", "bench", "routing", "--workload", workload["name"]]
    cmd += ["--policies", policy, "--seed", str(setup["seed"]), "--rate", str(setup["rate"])]
    if variant is not None:
        cmd += ["--variant", f"{VARIANT}={variant}"]
    cmd += ["--replicas", str(setup["replicas"]), "--profile", setup["replica_profile"]]
    if setup.get("kv_blocks"):
        cmd += ["--kv-blocks", str(setup["kv_blocks"])]
    if setup.get("router_config"):
        cmd += ["--config", setup["router_config"]]
    if workload["name"].startswith("mooncake") and setup.get("kv_blocks"):
        cmd += ["--limit", str(workload["requests"])]
    cmd += ["--json", str(out), "--no-plots", "--quiet"]
    subprocess.run(cmd, check=True, cwd=ROUTING.parent.parent, stdout=subprocess.DEVNULL)
    result: dict[str, Any] = json.loads(out.read_text())["policies"][policy]
    return result


def _pair(figures: dict[str, Any]) -> str:
    hit, p99 = figures.get("hit_ratio"), figures.get("ttft_p99_s")
    return f"{hit:.1%} / {p99:.3f}" if hit is not None and p99 is not None else "-"


def row(label: str, table: dict[str, Any], new: dict[str, Any]) -> str:
    old = table["policies"]["extproc"]
    peers = {p: table["policies"][p] for p in PEERS if p in table["policies"]}
    best = max(peers.items(), key=lambda kv: kv[1].get("hit_ratio") or 0.0) if peers else None
    peer = f"{best[0]} {_pair(best[1])}" if best else "-"
    sticky = f"{old.get('sticky_stayed') or 0:.1%} -> {new.get('sticky_stayed') or 0:.1%}"
    return f"| {label} | {_pair(old)} | {_pair(new)} | {sticky} | {peer} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated labels (e.g. multi-turn,pressure-multi-turn@3000)")
    parser.add_argument("--out", type=Path, help="also write the table here")
    parser.add_argument("--variant", type=Path, help="a router config whose profile: is run in place of ours")
    args = parser.parse_args()
    wanted = set(args.only.split(",")) if args.only else None
    lines = [
        "| table | committed hit / TTFT p99 (s) | now | sticky turns kept | best peer (hit / p99) |",
        "|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for label, table in runs():
            if wanted is not None and label not in wanted:
                continue
            new = rerun(table, Path(tmp) / f"{label}.json", args.variant)
            lines.append(row(label, table, new))
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
