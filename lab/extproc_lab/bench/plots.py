"""The benchmark's PNG plots: hit ratio over time per policy, and per-replica load over time.

matplotlib is optional (``pip install 'extproc-router[bench]'``): without it the plots are skipped.
"""

from __future__ import annotations

import math
from pathlib import Path

from extproc_lab.bench.policies import CEILINGS, OURS
from extproc_lab.bench.routing import BenchResult


def write_plots(result: BenchResult, directory: Path, stem: str) -> list[Path]:
    """Write ``<stem>_hit_ratio.png`` and ``<stem>_load_heatmap.png``; returns the paths (none
    without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    directory.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(10, 5))
    spans = []
    for name, r in result.results.items():
        if not r.hit_series:
            continue
        xs = [(i + 0.5) * r.window_s for i in range(len(r.hit_series))]
        ys = [math.nan if v is None else v for v in r.hit_series]
        style = "--" if name in CEILINGS else "-"
        width = 2.5 if name == OURS else 1.2
        ax.plot(xs, ys, style, linewidth=width, label=name)
        spans.append(xs[-1])
    if spans:
        # A policy that collapses (herding onto one replica) can run ten times longer: keep the others readable.
        spans.sort()
        ax.set_xlim(0, min(spans[-1], 1.5 * spans[len(spans) // 2]))
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel("token hit ratio")
    ax.set_ylim(0, 1)
    ax.set_title(
        f"{result.workload.get('name', '')}: prefix-cache hit ratio over time ({result.setup.replicas} replicas)"
    )
    ax.legend(fontsize=7, ncol=3)
    ax.grid(alpha=0.3)
    path = directory / f"{stem}_hit_ratio.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)

    routed = [(n, r) for n, r in result.results.items() if r.load_series and r.load_series[0]]
    if routed:
        top = max(max(max(row) for row in r.load_series) for _, r in routed) or 1.0
        cols = 3
        rows = math.ceil(len(routed) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 2.3 * rows), squeeze=False, constrained_layout=True)
        image = None
        for k, (name, r) in enumerate(routed):
            ax = axes[k // cols][k % cols]
            image = ax.imshow(
                r.load_series,
                aspect="auto",
                interpolation="nearest",
                cmap="magma",
                vmin=0,
                vmax=top,
                extent=(0, len(r.load_series[0]) * r.window_s, len(r.load_series) - 0.5, -0.5),
            )
            ax.set_title(name, fontsize=9)
            ax.set_ylabel("replica", fontsize=7)
            ax.tick_params(labelsize=6)
        for k in range(len(routed), rows * cols):
            axes[k // cols][k % cols].axis("off")
        if image is not None:
            fig.colorbar(image, ax=axes, shrink=0.6, label="tokens computed per second")
        fig.suptitle(f"{result.workload.get('name', '')}: per-replica load over time (x: seconds)")
        path = directory / f"{stem}_load_heatmap.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
