"""Roots that follow the jobs: a root entry whose path ends in `/*` makes one root per directory
under it, named `<entry>-<dir>`, as job directories come and go while the daemon runs. A real
in-process daemon on its real socket, real torch files; the expansion's rules (names, links,
the cap) as plain functions over real directories."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path
from typing import Any

import pytest
from support.ckpts import save_single
from support.config import render_config
from support.wait import wait_until

from ckptd.config import load_config, parse_config
from ckptd.errors import ConfigError, NotFound
from ckptd.service.globs import derive, expand, list_dirs


def _root_names(d: Any) -> list[str]:
    doc = d.client.status()
    assert doc is not None
    return sorted(r["name"] for r in doc["roots"])


def test_a_job_directory_made_while_the_daemon_runs_becomes_a_root(
        inproc_daemon: Any, tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    (jobs / "early").mkdir(parents=True)
    d = inproc_daemon(roots=[{"name": "r1"}, {"name": "jobs", "path": str(jobs / "*")}],
                      start=False, scan_interval="0.3s")
    (jobs / "*").rmdir()  # the test layout makes every root's path; a glob has none
    d.start()
    assert _root_names(d) == ["jobs-early", "r1"]

    (jobs / "llm-7b").mkdir()
    wait_until(lambda: "jobs-llm-7b" in _root_names(d), 15.0, "the new job's root")
    save_single(jobs / "llm-7b", 10)
    record = d.wait_for("jobs-llm-7b", 10)
    assert record["state"] == "valid"
    listed = d.client.checkpoints("jobs-llm-7b")
    assert listed is not None and [c["step"] for c in listed] == [10]
    (added,) = [e for e in d.events("glob_roots_changed") if e["added"]]
    assert added["added"] == ["jobs-llm-7b"]

    # The job ends and its directory goes: the root retires, nothing is deleted.
    kept = tmp_path / "kept"
    shutil.move(str(jobs / "llm-7b"), str(kept))
    wait_until(lambda: "jobs-llm-7b" not in _root_names(d), 15.0, "the root to retire")
    assert (kept / "model_step_10.pt").is_file()
    assert [r.step for r in d.store.checkpoints("jobs-llm-7b")] == [10]
    assert any(e["removed"] == ["jobs-llm-7b"] for e in d.events("glob_roots_changed"))
    assert _root_names(d) == ["jobs-early", "r1"]

    # The same job back (a restart of the job): the root returns with its history.
    shutil.move(str(kept), str(jobs / "llm-7b"))
    wait_until(lambda: "jobs-llm-7b" in _root_names(d), 15.0, "the root to return")
    assert d.wait_for("jobs-llm-7b", 10)["state"] == "valid"


def test_links_hidden_dirs_and_files_under_a_glob_make_no_root(tmp_path: Path) -> None:
    jobs, outside = tmp_path / "jobs", tmp_path / "outside"
    for p in (jobs / "a", jobs / ".hidden", outside):
        p.mkdir(parents=True)
    (jobs / "escape").symlink_to(outside)
    (jobs / "notes.txt").write_text("x")
    assert list_dirs(jobs).dirs == ("a",)
    assert list_dirs(tmp_path / "missing").error == "no such directory"
    assert list_dirs(jobs, max_entries=1).truncated


def _entry(tmp_path: Path, name: str = "jobs") -> Any:
    cfg = parse_config({"roots": [{"name": name, "path": str(tmp_path / "*")}]}, tmp_path)
    (entry,) = cfg.globs
    return entry


def test_bad_or_colliding_names_are_skipped_with_a_reason(tmp_path: Path) -> None:
    entry = _entry(tmp_path)
    taken = {"jobs-b"}
    made, skipped = derive(entry, ["a", "b", "x" * 70, "sp ace"], taken)
    assert [r.name for r in made] == ["jobs-a"]
    assert made[0].path == tmp_path / "a"
    reasons = {s.directory: s.reason for s in skipped}
    assert "already the name" in reasons["b"]
    assert "not a usable root name" in reasons["x" * 70]
    assert "not a usable root name" in reasons["sp ace"]


def test_past_the_cap_new_directories_wait_and_existing_roots_stay(tmp_path: Path) -> None:
    entry = _entry(tmp_path)
    made, skipped = derive(entry, ["a", "b", "c"], set(), keep=["jobs-c"], cap=2)
    assert [r.name for r in made] == ["jobs-c", "jobs-a"]
    assert [(s.directory, "cap" in s.reason) for s in skipped] == [("b", True)]


def test_configured_roots_keep_their_names_over_a_glob(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    (jobs / "a").mkdir(parents=True)
    cfg = parse_config({"roots": [{"name": "jobs-a", "path": str(tmp_path / "solo")},
                                  {"name": "jobs", "path": str(jobs / "*")}]}, tmp_path)
    found = expand(cfg)
    assert [r.name for r in found.config.roots] == ["jobs-a"]
    assert [s.directory for s in found.skipped] == ["a"]


@pytest.mark.parametrize(("roots", "problem"), [
    ([{"name": "j", "path": "/data/*/ckpt"}], '"*" may only end'),
    ([{"name": "j", "path": "/data/jobs/*"}, {"name": "k", "path": "/data/jobs/k"}],
     "one root may not be inside another"),
])
def test_a_glob_in_the_wrong_place_or_over_another_root_is_refused(
        tmp_path: Path, roots: list[dict[str, str]], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        parse_config({"roots": roots}, tmp_path)


def test_a_glob_through_a_link_is_followed_once_like_a_root(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text(f'[[roots]]\nname = "j"\npath = "{tmp_path}/link/*"\n')
    (entry,) = load_config(cfg_file).globs
    assert entry.path == tmp_path.resolve() / "real" / "*"


def test_a_derived_root_is_found_by_name_after_its_directory_is_gone(tmp_path: Path) -> None:
    """What reads a root's remote by its name (loading from the remote) still finds a retired
    job's root: its settings are the glob entry's, its path the directory it had."""
    cfg = parse_config({"roots": [{"name": "job", "path": str(tmp_path / "*"),
                                   "upload": {"url": f"file://{tmp_path.parent}/remote"}}]},
                       tmp_path)
    root = cfg.root("job-llm-7b")
    assert (root.name, root.path) == ("job-llm-7b", tmp_path / "llm-7b")
    assert root.upload.url == f"file://{tmp_path.parent}/remote"
    for name in ("job", "job-", "job-.hidden", "other-x"):
        with pytest.raises(NotFound):
            cfg.root(name)


def test_a_reload_that_drops_the_glob_entry_retires_its_roots(inproc_daemon: Any,
                                                               tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    (jobs / "a").mkdir(parents=True)
    d = inproc_daemon(roots=[{"name": "r1"}, {"name": "jobs", "path": str(jobs / "*")}],
                      start=False)
    (jobs / "*").rmdir()
    d.start()
    assert _root_names(d) == ["jobs-a", "r1"]
    data = tomllib.loads(d.config.read_text())
    d.config.write_text(render_config(data["daemon"],
                                      [r for r in data["roots"] if r["name"] != "jobs"]))
    assert d.reload()
    assert _root_names(d) == ["r1"]
    assert (jobs / "a").is_dir()


def test_an_unreadable_glob_directory_keeps_its_roots_a_missing_one_retires_them(
        tmp_path: Path) -> None:
    """A listing that fails (here: not a directory; permissions or I/O alike) says nothing
    about the jobs, so the roots stay; a directory that is gone retires them."""
    jobs = tmp_path / "jobs"
    (jobs / "a").mkdir(parents=True)
    cfg = parse_config({"roots": [{"name": "j", "path": str(jobs / "*")}]}, tmp_path)
    assert [r.name for r in expand(cfg).config.roots] == ["j-a"]
    shutil.rmtree(jobs)
    found = expand(cfg, active=["j-a"])
    assert found.config.roots == () and "no such directory" in found.problems[0]
    jobs.write_text("not a directory")
    found = expand(cfg, active=["j-a", "other-x"])
    assert [r.name for r in found.config.roots] == ["j-a"]
    assert found.problems and "no such directory" not in found.problems[0]
