"""One version everywhere a release is named: the package (``trainguard.__version__``, which the
wheel's metadata reads), the image (the Dockerfile's VERSION and label), the image tag the
Kubernetes manifests deploy, and the README's build command; the license the metadata names is
the LICENSE file's; the image carries the agent's extra."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import trainguard

REPO = Path(__file__).resolve().parents[2]


def test_the_image_and_the_manifests_name_the_packages_version() -> None:
    version = trainguard.__version__
    docker = (REPO / "infra" / "docker" / "Dockerfile").read_text()
    assert re.search(r"^ARG VERSION=(\S+)$", docker, re.M)[1] == version  # type: ignore[index]
    kustomization = (REPO / "infra" / "k8s" / "base" / "kustomization.yaml").read_text()
    assert re.search(r"newTag: (\S+)", kustomization)[1] == version  # type: ignore[index]
    readme = (REPO / "README.md").read_text()
    tags = set(re.findall(r"trainguard:(\d[\w.]*)", readme + docker))
    assert tags == {version}, tags


def test_the_wheel_reads_that_version_and_names_the_license_file() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "trainguard.__version__"}
    assert project["project"]["license"] == "Apache-2.0"
    assert project["project"]["license-files"] == ["LICENSE"]
    assert (REPO / "LICENSE").read_text().lstrip().startswith("Apache License\n")


def test_the_image_installs_the_agents_extra() -> None:
    docker = (REPO / "infra" / "docker" / "Dockerfile").read_text()
    extras = re.search(r'pip install "\.\[([\w,]+)\]"', docker)
    assert extras is not None and "agent" in extras[1].split(","), (
        "the image must carry nvidia-ml-py and py-spy"
    )
    agent = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["agent"]
    assert {re.split(r"[<>=]", r)[0] for r in agent} >= {"torch", "nvidia-ml-py", "py-spy"}
