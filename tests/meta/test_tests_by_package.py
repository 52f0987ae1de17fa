"""The suite is arranged by package (docs/TESTING.md, "Where a package's tests are"): every test
module sits in the directory of the ckptd package it tests, or in one of the few directories
for what belongs to no single package, so an engineer changing a package finds its tests in one
place."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
PACKAGE = TESTS.parent / "ckptd"
# Not a package's: the doc checks, whole-daemon runs, the deployment files, the suite's own
# helpers and checks, the real-framework suite (its own environment), shared support and data.
OTHERS = {"docs", "e2e", "deploy", "meta", "frameworks", "support", "golden"}


def test_no_test_module_sits_at_the_top_of_tests() -> None:
    flat = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert not flat, f"place these in the directory of the package they test: {flat}"


def test_every_test_directory_is_a_package_of_ckptd_or_a_named_other() -> None:
    packages = {p.stem for p in PACKAGE.iterdir()
                if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}
    dirs = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert not dirs - packages - OTHERS, sorted(dirs - packages - OTHERS)


def test_test_module_names_are_unique() -> None:
    """No `__init__.py` in tests/: pytest imports each module by its basename."""
    names = [p.name for p in TESTS.rglob("test_*.py") if "frameworks" not in p.parts]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
