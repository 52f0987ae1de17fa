"""What the package promises people who take it, read from pyproject.toml and this checkout: a
LICENSE that is the license pyproject names, pre-1.0 dependencies capped (a 0.x minor may
break) by ranges the tested environment satisfies, the metadata an index page shows, the
typed marker shipped, and a README whose install lines work from this repository."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def project() -> dict[str, Any]:
    doc: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return doc


def test_the_license_file_is_the_license_pyproject_names() -> None:
    meta = project()["project"]
    assert meta["license"] == "Apache-2.0"
    assert meta["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the whole text, not a pointer to it


def test_pre_1_0_dependencies_are_capped_and_the_tested_versions_fit() -> None:
    meta = project()["project"]
    reqs = [Requirement(r) for r in meta["dependencies"]]
    reqs += [Requirement(r) for r in meta["optional-dependencies"]["torch"]]
    for req in reqs:
        installed = Version(version(req.name))
        assert req.specifier.contains(installed, prereleases=True), (str(req), installed)
        lows = [Version(s.version) for s in req.specifier if s.operator == ">="]
        caps = [Version(s.version) for s in req.specifier if s.operator == "<"]
        if lows and lows[0].major == 0:
            assert caps, f"{req}: a 0.x dependency without an upper bound"
            assert caps[0].major == 0 and caps[0] > installed, str(req)
    torch, = (r for r in reqs if r.name == "torch")
    assert torch.specifier.contains("2.13.0")


def test_the_index_metadata_and_the_typed_marker() -> None:
    meta = project()["project"]
    assert "Typing :: Typed" in meta["classifiers"]
    assert "Operating System :: POSIX :: Linux" in meta["classifiers"]
    py = [c for c in meta["classifiers"]
          if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    assert py == [f"Programming Language :: Python :: {meta['requires-python'].removeprefix('>=')}"]
    urls = meta["urls"]
    assert {"Homepage", "Repository", "Documentation", "Issues", "Changelog"} <= set(urls)
    assert all(u.startswith(urls["Repository"]) for u in urls.values()), urls
    assert (ROOT / "ckptd" / "py.typed").is_file()
    assert "py.typed" in project()["tool"]["setuptools"]["package-data"]["ckptd"]


def test_the_readme_installs_from_this_repository() -> None:
    """No release is published yet: the README's install lines are from a clone or git."""
    text = (ROOT / "README.md").read_text()
    install = text.split("## Install", 1)[1].split("\n## ", 1)[0]
    lines = re.findall(r"^pip install (\S+)", install, re.M)
    assert lines == [".", "'.[torch]'"], lines
    repo = project()["project"]["urls"]["Repository"]
    assert f"git clone {repo}" in install
    assert f"pip install 'ckptd @ git+{repo}'" in install
    blocks = "\n".join(re.findall(r"^```sh\n(.*?)^```", text, re.M | re.S))
    assert not re.search(r"pip install '?ckptd\b", blocks), "an install from an index"
