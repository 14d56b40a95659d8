"""Every header the router reads is named in docs/security.md's table, with who may set it and
where it is stripped: the names are derived from the router's code, so a header read tomorrow
that the table does not name fails here."""

from __future__ import annotations

import ast
import re

from tests.conftest import ROOT

TABLE_SECTION = "## Headers the router reads, and who may set them"
HEADER_LIKE = re.compile(r"^(:[a-z]+|x-[a-z0-9-]+|authorization|cookie|traceparent|tracestate)$")


def _constants(trees: list[ast.Module]) -> dict[str, list[str]]:
    """Module-level names bound to a string, or a tuple of strings, in any module."""
    out: dict[str, list[str]] = {}
    for tree in trees:
        for node in tree.body:
            target, value = None, None
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
            elif isinstance(node, ast.AnnAssign):
                target, value = node.target, node.value
            if not isinstance(target, ast.Name) or value is None:
                continue
            strings = _strings(value)
            if strings:
                out.setdefault(target.id, []).extend(strings)
    return out


def _strings(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _about_headers(node: ast.expr) -> bool:
    """An expression naming a header map (``headers``, ``self.headers``, ``carrier`` ...)."""
    text = ast.unparse(node).lower()
    return "header" in text or "carrier" in text


def headers_read(sources: dict[str, str]) -> set[str]:
    """The header names the code reads: ``<headers>.get(NAME)``, ``NAME in <headers>``, module
    constants named ``*_HEADER(S)`` or ``TRACE*``, config options named ``*header`` or of a
    ``Headers`` section, and session sources of kind ``header``. NAME may be a literal or a
    module constant (of any module: constants keep their names when imported)."""
    trees = [ast.parse(text) for text in sources.values()]
    constants = _constants(trees)

    def resolve(node: ast.expr) -> list[str]:
        if isinstance(node, ast.Name):
            return constants.get(node.id, [])
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            return constants.get(node.value.id, [])
        return _strings(node)

    found: list[str] = []
    for name, values in constants.items():
        if name.endswith(("_HEADER", "_HEADERS")) or name.startswith("TRACE"):
            found += values
    for tree in trees:
        for node in ast.walk(tree):
            call = isinstance(node, ast.Call) and node.args
            if call and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                if _about_headers(node.func.value):
                    found += resolve(node.args[0])
            elif call and isinstance(node.func, ast.Name) and node.func.id == "SessionSource":
                found += _strings(node.args[1]) if _strings(node.args[0]) == ["header"] else []
            if (
                isinstance(node, ast.Compare)
                and any(isinstance(op, ast.In) for op in node.ops)
                and _about_headers(node.comparators[0])
            ):
                found += resolve(node.left)
            if isinstance(node, ast.ClassDef):
                in_headers_section = "header" in node.name.lower()
                for item in node.body:
                    if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                        continue
                    value = item.value
                    option = isinstance(value, ast.Call) and ast.unparse(value.func) == "option" and value.args
                    named = in_headers_section or item.target.id.endswith("header")
                    if named and option and isinstance(value, ast.Call):
                        found += resolve(value.args[0])
                    elif named and value is not None:
                        found += _strings(value)
    return {f.lower() for f in found if HEADER_LIKE.match(f.lower())}


def table_names() -> set[str]:
    text = (ROOT / "docs" / "security.md").read_text()
    section = text[text.index(TABLE_SECTION) :]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            first = line.split("|")[1]
            names.update(n.lower() for n in re.findall(r"`([^`]+)`", first))
    return names


def router_sources() -> dict[str, str]:
    return {str(p): p.read_text() for p in sorted((ROOT / "extproc").rglob("*.py")) if "_proto" not in p.parts}


def test_the_scan_finds_what_the_router_is_known_to_read() -> None:
    found = headers_read(router_sources())
    known = {
        ":path",
        ":status",
        "authorization",
        "cookie",
        "x-tenant-id",
        "x-session-id",
        "x-slo-ttft-ms",
        "x-llm-d-slo-tpot-ms",
        "x-request-id",
        "x-model",
        "x-canary",
        "traceparent",
        "x-prefiller-host-port",
        "x-target-cluster",
        "x-gateway-destination-endpoint",
        "x-extproc-stream",
        "x-envoy-attempt-count",
    }
    assert known <= found, known - found


def test_the_scan_catches_a_header_read_tomorrow() -> None:
    new = {"new.py": 'X_ROLE_HEADER = "x-role"\ndef f(headers):\n    return headers.get("x-budget-override")\n'}
    assert headers_read(new) == {"x-role", "x-budget-override"}


def test_every_header_the_router_reads_is_in_the_security_table() -> None:
    missing = headers_read(router_sources()) - table_names()
    assert not missing, f"read by the router but not in docs/security.md's table: {sorted(missing)}"
