"""What compiling the request path's two largest pure leaves with mypyc would save, measured.

    .venv/bin/python benchmarks/mypyc_leaves.py

Copies ``extproc/request/prefix.py`` (block hashing) and ``extproc/fleet/cache/inflight.py`` (the
in-flight prefix table, whose add and remove touch every block of a prompt) into a scratch
package, compiles that copy with mypyc (needs gcc and the dev extra's mypy), and times both
modules, interpreted and compiled, on an 8 KB prompt (128 blocks of 64 characters), each in a
fresh process. Nothing of the repository is changed or built.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEAVES = {"prefix.py": ROOT / "extproc/request/prefix.py", "inflight.py": ROOT / "extproc/fleet/cache/inflight.py"}
TIMING = """
import sys, time
sys.path.insert(0, sys.argv[1])
from leaves import inflight, prefix
text = ("gateway replica prefix cache session token " * 200)[:8192]
seed, n = prefix.model_seed("m"), 5000
best_h = best_i = float("inf")
for _ in range(5):
    t = time.process_time()
    for _ in range(n):
        hs = prefix.block_hashes(text, seed, 64, 2000)
    best_h = min(best_h, (time.process_time() - t) / n)
    table = inflight.InflightPrefixes()
    t = time.process_time()
    for _ in range(n):
        table.add("r1", hs)
        table.remove("r1", hs)
    best_i = min(best_i, (time.process_time() - t) / n)
compiled = prefix.__file__.endswith(".so")
print(f"{'compiled' if compiled else 'interpreted'}: {len(hs)} blocks: block_hashes {best_h * 1e6:.1f} us, "
      f"in-flight add + remove {best_i * 1e6:.1f} us")
"""


def main() -> None:
    """Time the leaves interpreted, compile them, time them again."""
    mypyc = shutil.which("mypyc", path=str(Path(sys.executable).parent))
    if mypyc is None or shutil.which("gcc") is None:
        raise SystemExit("needs mypyc (the dev extra's mypy) and gcc")
    with tempfile.TemporaryDirectory(prefix="extproc-mypyc-") as tmp:
        plain, built = Path(tmp) / "plain", Path(tmp) / "built"
        for where in (plain, built):
            (where / "leaves").mkdir(parents=True)
            (where / "leaves" / "__init__.py").write_text("")
            for name, source in LEAVES.items():
                shutil.copyfile(source, where / "leaves" / name)
        subprocess.run(
            [mypyc, "leaves/prefix.py", "leaves/inflight.py"], cwd=built, check=True, capture_output=True, timeout=600
        )
        for where in (plain, built):
            out = subprocess.run([sys.executable, "-c", TIMING, str(where)], check=True, capture_output=True, text=True)
            print(out.stdout.strip())


if __name__ == "__main__":
    main()
