"""The documentation holds: every relative link resolves, every ``extproc`` command shown parses.

Links: every ``[text](target)`` and ``![alt](target)`` outside code in README.md, docs/*.md and the
Envoy and Kubernetes READMEs names a file of the repository, and a ``#fragment`` names one of the
target's headings, slugged as GitHub does. Commands: every line of a ``sh``, ``bash`` or ``console``
block whose command is ``extproc`` (also as ``.venv/bin/extproc`` or ``python -m extproc``) is parsed,
never run, by the command line's own parser, the lab's sub-commands included.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.adapters.cli import build_parser
from tests.conftest import ROOT

PAGES = (
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "k8s" / "README.md",
    ROOT / "envoy" / "README.md",
)
SHELL_BLOCKS = {"sh", "bash", "console", "shell"}
FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+-]*)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"`+[^`]*`+")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
PLACEHOLDER = re.compile(r"<[^<>\s]+>")
COMMAND = re.compile(r"^(?:\S*/)?extproc$")


def _lines_outside_code(text: str) -> Iterator[tuple[int, str]]:
    """Numbered lines that are prose: fenced and indented code left out."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced and not line.startswith("    "):
            yield number, line


def _blocks(text: str) -> Iterator[tuple[int, str, list[str]]]:
    """Fenced code blocks: the line each starts at, its language and its lines."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if opened is None:
            i += 1
            continue
        start, language, body = i + 1, opened.group(2).lower(), []
        i += 1
        while i < len(lines) and not FENCE.match(lines[i]):
            body.append(lines[i])
            i += 1
        yield start, language, body
        i += 1


def github_slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: the rendered text lowercased, punctuation dropped, spaces to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays, its target goes
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a page, duplicates numbered as GitHub numbers them (-1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in _lines_outside_code(text):
        match = HEADING.match(line)
        if match is None:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(page: Path, text: str | None = None) -> list[str]:
    """The relative links of ``page`` (or of ``text`` read as if at ``page``) that name no file or heading."""
    broken = []
    text = page.read_text(encoding="utf-8") if text is None else text
    for number, line in _lines_outside_code(text):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not ours to check
                continue
            path, _, fragment = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page.resolve()
            where = f"{page.relative_to(ROOT)}:{number}: {target}"
            if not resolved.exists():
                broken.append(f"{where} (no such file)")
            elif fragment and (resolved.is_dir() or resolved.suffix != ".md"):
                broken.append(f"{where} (an anchor into a file that is not markdown)")
            elif fragment and fragment not in anchors(text if resolved == page else resolved.read_text("utf-8")):
                broken.append(f"{where} (no such heading in {resolved.relative_to(ROOT)})")
    return broken


def shown_commands(page: Path, text: str | None = None) -> Iterator[tuple[str, list[str]]]:
    """Each ``extproc`` command in the page's shell blocks, continuation lines joined, as argv."""
    for start, language, body in _blocks(page.read_text(encoding="utf-8") if text is None else text):
        if language not in SHELL_BLOCKS:
            continue
        joined: list[tuple[int, str]] = []
        for offset, line in enumerate(body):
            if joined and joined[-1][1].endswith("\\"):
                joined[-1] = (joined[-1][0], joined[-1][1][:-1] + " " + line.strip())
            else:
                joined.append((start + 1 + offset, line.strip()))
        for number, shown in joined:
            line = shown.removeprefix("$ ")
            if PLACEHOLDER.search(line):  # a shape with <placeholders> for values, not a command
                continue
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            try:
                words = list(lexer)
            except ValueError as exc:
                raise AssertionError(f"{page.relative_to(ROOT)}:{number}: {exc}: {line}") from exc
            yield from _commands_in(f"{page.relative_to(ROOT)}:{number}", words)


def _commands_in(where: str, words: list[str]) -> Iterator[tuple[str, list[str]]]:
    """The ``extproc`` argvs among a line's pipelines and lists (``a && b | c > f``)."""
    command: list[str] = []
    for word in [*words, ";"]:
        if word and set(word) <= set(";&|<>"):
            if command:
                argv = _extproc_argv(command)
                if argv is not None:
                    yield where, argv
            command = []
        else:
            command.append(word)


def _extproc_argv(words: list[str]) -> list[str] | None:
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):  # VAR=value before a command
        words = words[1:]
    while words and words[0] in ("nice", "-n", "10", "sudo", "exec", "time"):
        words = words[1:]
    if words and COMMAND.match(words[0]):
        return words[1:]
    if len(words) >= 3 and re.match(r"^(?:\S*/)?python3?$", words[0]) and words[1:3] == ["-m", "extproc"]:
        return words[3:]
    return None


def _strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parser and its sub-parsers with abbreviations refused: a doc must spell a flag out."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _strict(child)
    return parser


def parse_error(argv: list[str]) -> str | None:
    """What the ``extproc`` parser says against ``argv``, or None when it parses."""
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
        try:
            _strict(build_parser()).parse_args(argv)
        except SystemExit as exc:
            if exc.code not in (0, None):  # --help exits 0
                return errors.getvalue().strip().splitlines()[-1]
    return None


def test_every_relative_link_resolves() -> None:
    assert [page for page in PAGES if not page.exists()] == []
    broken = [link for page in PAGES for link in broken_links(page)]
    assert not broken, "\n".join(broken)


def test_every_command_shown_parses() -> None:
    shown = [found for page in PAGES for found in shown_commands(page)]
    # The README alone shows more than this; a pattern gone wrong would find none and pass.
    assert len(shown) >= 20, shown
    failures = [
        f"{where}: extproc {shlex.join(argv)}: {error}" for where, argv in shown if (error := parse_error(argv))
    ]
    assert not failures, "\n".join(failures)


def test_the_checks_catch_a_broken_link_an_unknown_flag_and_a_missing_heading() -> None:
    page = (ROOT / "docs" / "architecture.md").resolve()  # read as if this text were there
    text = (
        "# A page\n\n[gone](no-such-file.md), [there](../README.md), [no heading](../README.md#no-such-heading),\n"
        "[own heading](#a-page), `[in code](nowhere.md)`\n\n"
        "```sh\nextproc serve --listen 127.0.0.1:9002 \\\n  --no-such-flag x\nextproc check-config a.yaml\n```\n"
    )
    links = broken_links(page, text)
    commands = list(shown_commands(page, text))
    assert [link.split(": ", 1)[1] for link in links] == [
        "no-such-file.md (no such file)",
        "../README.md#no-such-heading (no such heading in README.md)",
    ]
    assert [argv for _, argv in commands] == [
        ["serve", "--listen", "127.0.0.1:9002", "--no-such-flag", "x"],
        ["check-config", "a.yaml"],
    ]
    assert "unrecognized arguments: --no-such-flag x" in (parse_error(commands[0][1]) or "")
    assert parse_error(commands[1][1]) is None
    assert parse_error(["serve", "--replic", "a=127.0.0.1:1"]) is not None  # abbreviations are refused
    assert parse_error(["bench", "routing", "--workload", "multi-turn"]) is None  # the lab's commands are there


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("1. Plain Envoy", "1-plain-envoy"),
        ("3. Gateway API Inference Extension: InferencePool", "3-gateway-api-inference-extension-inferencepool"),
        ("Under KV pressure (issue 13)", "under-kv-pressure-issue-13"),
        ("The `extproc admin` command", "the-extproc-admin-command"),
        ("Health, load and failover", "health-load-and-failover"),
        ("Scaling 8 -> 10 -> 8", "scaling-8---10---8"),
    ],
)
def test_headings_slug_as_github_slugs_them(heading: str, slug: str) -> None:
    assert github_slug(heading) == slug


def test_every_alert_names_a_runbook_section_that_exists() -> None:
    import yaml

    rules_file = ROOT / "k8s" / "observability" / "alerts.rules.yaml"
    runbooks = ROOT / "docs" / "runbooks.md"
    alerts = [r for g in yaml.safe_load(rules_file.read_text())["groups"] for r in g["rules"] if "alert" in r]
    assert len(alerts) >= 8
    sections = anchors(runbooks.read_text(encoding="utf-8"))
    wrong = []
    for alert in alerts:
        url = alert["annotations"].get("runbook_url", "")
        path, _, fragment = url.partition("#")
        if path != "docs/runbooks.md" or fragment not in sections or fragment != alert["alert"].lower():
            wrong.append(f"{alert['alert']}: {url!r}")
    assert wrong == []
    # and no section for an alert that is gone
    assert {s for s in sections if s.startswith("extproc")} == {a["alert"].lower() for a in alerts}
