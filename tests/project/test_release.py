"""What a release is made of: the licence, the changelog, one version followed everywhere it is
written, and the config reference made from the model."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version

import yaml

import extproc
from extproc.config.keys import config_keys
from extproc.config.reference import BEGIN, with_reference
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


def test_the_config_reference_is_made_from_the_model() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert with_reference(page) == page, "docs/configuration.md's reference is stale: make config-docs"
    documented = set(re.findall(r"`(EXTPROC_[A-Z_]+)`", page[page.index(BEGIN) :]))
    assert documented == {k.env for k in config_keys()}
