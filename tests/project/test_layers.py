"""The layering of docs/architecture.md, checked on every import: the router never imports the lab,
within the router imports point down, and the lab uses only the router's public names."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import ROOT

# Higher may import lower (and its own group); see docs/architecture.md. Each folder of extproc/ is
# a layer; a module's group is the longest name below that it is or lies in, so a folder may rank
# some of its parts below the rest (the core's ledger below its steps).
RANKS: dict[str, float] = {
    "extproc.api": 10,  # the public surface: the only router names the lab, fuzzers and benchmarks import
    "extproc": 9,  # the package's public re-exports
    "extproc.__main__": 9,
    "extproc.adapters": 9,  # the ext_proc server, admin API and console, Envoy config, the command, /metrics
    "extproc.app": 8,  # the wiring of the request path's collaborators, and the plan an adapter carries out
    "extproc.core": 7,  # the request core: steps with no I/O, their effects, admission, outcomes, charges
    "extproc.core.bookkeeping": 6.5,  # what routing a request changes (load, caches, tenants), and undoes
    "extproc.core.membership": 6.5,  # membership, cordons and drains, and the moves they cause
    "extproc.config": 6,
    "extproc.fleet": 5,  # health, discovery, KV events and cache estimates, rebalance, the fair queue
    "extproc.state": 4,  # the affinity stores, token budgets, tenants, metering
    "extproc.observe": 3,  # decision feed, tracing, hot keys
    "extproc.observe.metrics": 3,  # apart: only the wiring imports it (below)
    "extproc.routing": 2,
    "extproc.request": 1,  # the wire of a request and its answer (bodies, sessions, usage, token timing)
    "extproc._proto": 0,  # generated from proto/ (scripts/gen_proto.py)
    "extproc.base": 0,  # time and chance, the event loop, logs, sampling, validation, engine rates
}


def _group(module: str) -> str:
    """The longest name in :data:`RANKS` that ``module`` is or lies in (``module`` itself if none)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in RANKS:
            return name
    return module


def _imports(package_dir: Path) -> Iterator[tuple[str, str, str]]:
    """(importing module, imported module, file) for every absolute import under ``package_dir``."""
    base = package_dir.parent
    for path in sorted(package_dir.rglob("*.py")):
        if "_proto" in path.parts:
            continue
        module = ".".join(path.relative_to(base).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield module, alias.name, str(path.relative_to(ROOT))
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                yield module, node.module, str(path.relative_to(ROOT))


def test_the_router_never_imports_the_lab() -> None:
    offenders = [
        f"{where}: {target}" for _, target, where in _imports(ROOT / "extproc") if target.startswith("extproc_lab")
    ]
    assert offenders == []


def test_router_imports_point_down() -> None:
    upward: set[tuple[str, str]] = set()
    unranked: set[str] = set()
    for module, target, _ in _imports(ROOT / "extproc"):
        if not target.startswith("extproc") or target.startswith("extproc_lab"):
            continue
        src, dst = _group(module), _group(target)
        if src == dst:
            continue
        if src not in RANKS or dst not in RANKS:
            unranked |= {g for g in (src, dst) if g not in RANKS}
        elif RANKS[dst] > RANKS[src]:
            upward.add((src, dst))
    assert unranked == set(), "place new modules in RANKS and docs/architecture.md"
    assert upward == set(), "an import points up a layer"


def _private(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


def _router_module(name: str | None) -> bool:
    return name is not None and (name == "extproc" or name.startswith("extproc."))


def test_the_lab_imports_no_private_name_of_the_router() -> None:
    offenders = []
    for path in sorted((ROOT / "lab").rglob("*.py")):
        where = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                offenders += [f"{where}: {a.name}" for a in node.names if _router_module(a.name) and _private(a.name)]
            elif isinstance(node, ast.ImportFrom) and _router_module(node.module):
                assert node.module is not None
                names = [f"{node.module}.{a.name}" for a in node.names]
                offenders += [f"{where}: {name}" for name in names if _private(name)]
    assert offenders == []


# Where the router is used from outside, and the only router modules they may import.
OUTSIDE = ("lab", "benchmarks", "fuzz")
PUBLIC_SURFACE = ("extproc.api", "extproc.api.sim")


def test_the_lab_fuzzers_and_benchmarks_import_only_the_public_surface() -> None:
    """They import the router through ``extproc.api`` and ``extproc.api.sim`` alone, and only the
    names those list in ``__all__``: the rest of ``extproc`` may move without touching them."""
    exported = {name: set(importlib.import_module(name).__all__) for name in PUBLIC_SURFACE}
    offenders = []
    for top in OUTSIDE:
        for path in sorted((ROOT / top).rglob("*.py")):
            where = path.relative_to(ROOT)
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    offenders += [
                        f"{where}: import {a.name}"
                        for a in node.names
                        if _router_module(a.name) and a.name not in PUBLIC_SURFACE
                    ]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and _router_module(node.module):
                    assert node.module is not None
                    if node.module not in exported:
                        offenders.append(f"{where}: from {node.module}")
                        continue
                    offenders += [
                        f"{where}: {node.module}.{a.name}" for a in node.names if a.name not in exported[node.module]
                    ]
    assert offenders == [], "import it from extproc.api (or extproc.api.sim), adding it to __all__ there"


def test_lab_subclasses_of_router_classes_touch_no_private_member() -> None:
    """A lab class built on a router class neither overrides nor uses the base's private members:
    a driver of its own goes through the public API, so the router may change its insides."""
    offenders = []
    for path in sorted((ROOT / "lab").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {
            alias.asname or alias.name: node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and _router_module(node.module)
            for alias in node.names
        }
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            bases = [
                getattr(importlib.import_module(imported[b.id]), b.id)
                for b in cls.bases
                if isinstance(b, ast.Name) and b.id in imported
            ]
            if not bases:
                continue
            own = {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
            own |= {
                n.attr
                for n in ast.walk(cls)
                if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and _is_self(n.value)
            }
            for node in ast.walk(cls):
                name = node.name if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else None
                if isinstance(node, ast.Attribute) and _is_self(node.value):
                    name = node.attr
                if name is None or not _private(name):
                    continue
                if name not in own or any(hasattr(base, name) for base in bases):
                    offenders.append(f"{path.relative_to(ROOT)}: {cls.name}.{name}")
    assert offenders == []


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def test_test_files_import_no_other_test_file() -> None:
    """What tests share lives in tests/helpers.py and tests/conftest.py, so any test file can move
    on its own."""
    offenders = [
        f"{where}: {target}"
        for _, target, where in _imports(ROOT / "tests")
        if target.rpartition(".")[2].startswith("test_")
    ]
    assert offenders == []


# Subsystems report through observer protocols of their own; only these wire the metrics in (and
# the public surface re-exports the KV-event metrics, which the lab wires a subscriber with).
METRICS_WIRING = (
    "extproc.observe.metrics",
    "extproc.app.router",
    "extproc.core",
    "extproc.adapters.server",
    "extproc.adapters.cli",
    "extproc.adapters.telemetry",
    "extproc.api",
)


def _wires_metrics(module: str) -> bool:
    """In the wiring's modules, the core's ledger below its steps aside."""
    within = any(module == n or module.startswith(n + ".") for n in METRICS_WIRING)
    return within and _group(module) not in ("extproc.core.bookkeeping", "extproc.core.membership")


def test_only_the_wiring_imports_the_metrics() -> None:
    offenders = {
        f"{where}: {target}"
        for module, target, where in _imports(ROOT / "extproc")
        if _group(target) == "extproc.observe.metrics" and not _wires_metrics(module)
    }
    assert offenders == set(), "report through the subsystem's observer protocol"


def _module_names(package_dir: Path) -> dict[str, Path]:
    base = package_dir.parent
    return {
        ".".join(path.relative_to(base).with_suffix("").parts).removesuffix(".__init__"): path
        for path in sorted(package_dir.rglob("*.py"))
        if "_proto" not in path.parts
    }


def _top_level_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports that run when the module is imported: at its top level, in classes and in
    ``if`` (``if TYPE_CHECKING:`` too: a circle of types is still a circle of concepts), ``try``
    and ``with`` blocks; not in functions, which run later."""
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.ClassDef | ast.With):
            pending += node.body
        elif isinstance(node, ast.If):
            pending += [*node.body, *node.orelse]
        elif isinstance(node, ast.Try):
            pending += [*node.body, *node.orelse, *node.finalbody, *(s for h in node.handlers for s in h.body)]


def import_graph(package_dir: Path) -> dict[str, dict[str, str]]:
    """Per module of the package, the package's modules it imports at import time, each with where
    (``file:line``). ``from pkg import name`` imports ``pkg.name`` where that is a module, else
    ``pkg``; a package's ``__init__`` that runs first is not an edge (Python imports it once, and a
    package importing its own modules would otherwise be a circle with each)."""
    modules = _module_names(package_dir)
    graph: dict[str, dict[str, str]] = {m: {} for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in _top_level_imports(ast.parse(path.read_text(encoding="utf-8"))):
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                parts = package.split(".")
                origin = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
                source = ".".join(p for p in (origin, node.module or "") if p)
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            for target in targets:
                if target in modules and target != module:
                    graph[module].setdefault(target, where)
    return graph


def import_circles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root, imported in graph.items():
        if root in index:
            continue
        work = [(root, iter(imported))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            target = next(edges, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph[target])))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_the_circle_finder_finds_circles() -> None:
    graph = {"a": {"b": "a.py:1"}, "b": {"c": "b.py:1"}, "c": {"a": "c.py:1", "d": "c.py:2"}, "d": {}, "e": {"e": ""}}
    assert import_circles(graph) == [["a", "b", "c"]]
    assert import_circles({"a": {"b": ""}, "b": {}}) == []


def test_the_router_has_no_import_circle() -> None:
    """No two modules of the router import each other, directly or through others, at import time:
    a circle means neither can be understood (or loaded) first. Broken by moving the shared type
    down, or to a small module of its own, or by a Protocol; not by importing inside a function."""
    graph = import_graph(ROOT / "extproc")
    found = [
        ", ".join(members)
        + ": "
        + "; ".join(f"{graph[a][b]} imports {b}" for a in members for b in members if b in graph[a])
        for members in import_circles(graph)
    ]
    assert found == [], "import circles:\n" + "\n".join(found)


def test_unit_tests_mirror_the_router_s_folders() -> None:
    """Each folder of tests/unit is a folder of extproc/ (the tests of `extproc/fleet/health/` are in
    `tests/unit/fleet/health/`), so a module's tests are found where the module is."""
    units = ROOT / "tests" / "unit"
    folders = [p.relative_to(units) for p in sorted(units.rglob("*")) if p.is_dir() and p.name != "__pycache__"]
    assert folders, units
    assert [f for f in folders if not (ROOT / "extproc" / f).is_dir()] == []
