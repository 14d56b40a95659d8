"""The config reference of docs/configuration.md: every key of the model with its type, default,
environment variable and flag, and the flags kept by name, made from the model
(:mod:`extproc.config.keys`) by ``make config-docs``; a test fails when the page is stale."""

from __future__ import annotations

from pathlib import Path

from extproc.config.cli_flags import ALIASES
from extproc.config.keys import Key, config_keys
from extproc.config.model import Config

BEGIN = "<!-- reference: made from the config model by `make config-docs`; a test fails when it is stale -->"
END = "<!-- end of the reference -->"
LONGEST_DEFAULT = 48


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(k: Key) -> str:
    if k.default == "required":
        return "required (where its section is given)" if "." in k.path else "required"
    if ";" in k.default:  # a section of several kinds: each kind's default
        return "; ".join(f"`{_cell(part.strip())}`" for part in k.default.split(";"))
    if len(k.default) > LONGEST_DEFAULT:
        return "see [`examples/router.yaml`](../examples/router.yaml)"
    return f"`{_cell(k.default)}`" if k.default else "`''`"


def _row(k: Key) -> str:
    doc = k.description + (f" (with `type` {', '.join(k.within)})" if k.within else "")
    return f"| `{k.path}` | {_cell(k.type_name)} | {_default(k)} | `{k.env}` | `{k.flag}` | {_cell(doc)} |"


def reference_markdown() -> str:
    """The reference, between its markers."""
    head = "| key | type | default | variable | flag | what it does |\n|---|---|---|---|---|---|"
    sections: dict[str, list[Key]] = {}
    for k in config_keys():
        sections.setdefault(k.path.split(".")[0] if "." in k.path else "", []).append(k)
    out = [BEGIN, ""]
    for name, keys in sections.items():
        if name:
            doc = Config.model_fields[name].description or ""
            out.append(f"**`{name}`**: {_cell(doc)}.")
        else:
            out.append("**The top level.**")
        out += ["", head, *(_row(k) for k in keys), ""]
    out += [
        "**Flags kept by name.** Each sets a key above, read as that key is unless its form says otherwise; "
        "they have no variables of their own.",
        "",
        "| flag | key | form |\n|---|---|---|",
    ]
    for alias in ALIASES:
        form = alias.note or "as the key"
        out.append(f"| `{alias.name}` | `{alias.key}` | {_cell(form)} |")
    out += ["", END]
    return "\n".join(out)


def with_reference(page: str) -> str:
    """``page`` with the text between the markers replaced by the current reference."""
    start, end = page.index(BEGIN), page.index(END) + len(END)
    return page[:start] + reference_markdown() + page[end:]


def write(path: str | Path) -> None:
    """Bring the reference in the page at ``path`` up to date."""
    page = Path(path)
    page.write_text(with_reference(page.read_text()))
