"""What a release is made of: the licence, the changelog, one version followed everywhere it is
written, and the environment variables documented as the flags' table makes them."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version

import yaml

import extproc
from extproc.config.cli_flags import SERVE_FLAGS
from tests.conftest import ROOT


def package_version() -> str:
    declared: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return declared


def test_the_version_is_written_once_and_the_package_reports_it() -> None:
    assert extproc.__version__ == version("extproc-router") == package_version()
    assert not re.search(r'__version__ = "\d+\.', (ROOT / "extproc" / "__init__.py").read_text())


def test_the_image_and_the_manifests_carry_the_packages_version() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG VERSION=(\S+)$", dockerfile, re.M)[1] == package_version()  # type: ignore[index]
    for label in ("version", "revision", "licenses", "title"):
        assert f"org.opencontainers.image.{label}=" in dockerfile, label
    kustomization = yaml.safe_load((ROOT / "k8s" / "base" / "kustomization.yaml").read_text())
    assert [i["newTag"] for i in kustomization["images"]] == [package_version()]
    chart = ROOT / "charts" / "extproc" / "Chart.yaml"
    if chart.exists():
        assert yaml.safe_load(chart.read_text())["appVersion"] == package_version()


def test_the_licence_is_the_one_pyproject_declares_and_ships_in_the_image() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]["text"]
    assert declared == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert "!LICENSE" in (ROOT / ".dockerignore").read_text().splitlines()


def test_the_changelog_has_the_current_version() -> None:
    headings = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert headings[0] == "Unreleased" or headings[0] == package_version()
    assert package_version() in headings


def test_every_environment_variable_is_documented_as_the_table_makes_it() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    rows = [f"| `{f.env}` | `{f.name}` | `{f.key}` |" for f in SERVE_FLAGS]
    missing = [row for row in rows if row not in page]
    assert not missing, "docs/configuration.md lacks:\n" + "\n".join(missing)
    documented = set(re.findall(r"^\| `(EXTPROC_[A-Z_]+)` \|", page, re.M))
    assert documented == {f.env for f in SERVE_FLAGS}, "a documented variable no flag makes"
