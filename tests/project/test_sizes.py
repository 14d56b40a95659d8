"""Sizes a newcomer can read: no router module over 400 lines (generated code aside), and no
class on the request path with more than 12 methods."""

from __future__ import annotations

import ast

from tests.conftest import ROOT

MAX_LINES = 400
MAX_METHODS = 12
REQUEST_PATH = (
    "extproc/core",
    "extproc/app/router.py",
    "extproc/app/plan.py",
    "extproc/core/bookkeeping.py",
    "extproc/adapters/server",
)


def test_no_router_module_is_over_400_lines() -> None:
    over = {
        str(path.relative_to(ROOT)): n
        for path in sorted((ROOT / "extproc").rglob("*.py"))
        if "_proto" not in path.parts and (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert over == {}, "split the module by the domain concepts it holds"


def test_no_class_on_the_request_path_has_more_than_12_methods() -> None:
    over = {}
    for place in REQUEST_PATH:
        target = ROOT / place
        paths = sorted(target.rglob("*.py")) if target.is_dir() else [target]
        for path in paths:
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.ClassDef):
                    continue
                methods = [
                    f.name
                    for f in node.body
                    if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                    and not (f.name.startswith("__") and f.name.endswith("__"))
                ]
                if len(methods) > MAX_METHODS:
                    over[f"{path.relative_to(ROOT)}:{node.name}"] = len(methods)
    assert over == {}, "a class on the request path does one job: give the rest to a collaborator"
