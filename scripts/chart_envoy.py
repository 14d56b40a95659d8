"""charts/extproc/files/envoy-sidecar.yaml: the Envoy bootstrap of the chart's sidecar layout,
rendered by ``extproc envoy-config --scenario kubernetes`` (the k8s gateway pod's) for a router
config whose names and ports are placeholders the chart replaces with its values. Run by
``make chart-envoy``; tests/project/test_helm.py keeps the file equal to what this renders, and
the chart's rendered bootstrap equal to what the renderer makes for the chart's own router config.
"""

from __future__ import annotations

import contextlib
import io
import sys
import tempfile
from pathlib import Path

import yaml

# Placeholders the chart's template replaces (charts/extproc/templates/_helpers.tpl, extproc.envoyConfig).
PLACEHOLDERS = {
    "service": "sidecar-model-service",
    "namespace": "sidecar-model-namespace",
    "model_port": 65001,
    "router_port": 65002,
    "http_port": 65003,
}
OUT = Path(__file__).resolve().parent.parent / "charts" / "extproc" / "files" / "envoy-sidecar.yaml"


def render_envoy(service: str, namespace: str, model_port: int, router_port: int, http_port: int) -> str:
    """The bootstrap ``extproc envoy-config`` renders for the sidecar layout's router config."""
    from extproc.api import cli_main as main

    config = {
        "mode": "endpoint",
        "listen": f"0.0.0.0:{router_port}",
        "discovery": {"type": "kubernetes", "service": service, "namespace": namespace, "port": model_port},
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "router.yaml"
        path.write_text(yaml.safe_dump(config))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            argv = ["envoy-config", "--config", str(path), "--scenario", "kubernetes"]
            code = main([*argv, "--listen", f"0.0.0.0:{http_port}"])
        if code != 0:
            raise SystemExit(f"extproc envoy-config failed ({code})")
    return out.getvalue()


def generate() -> str:
    """The file's text: the bootstrap with the placeholders."""
    return render_envoy(**PLACEHOLDERS)  # type: ignore[arg-type]


if __name__ == "__main__":
    OUT.write_text(generate())
    print(f"wrote {OUT}", file=sys.stderr)
