"""Test configs from plain dicts: TOML rendering and the on-disk layout a daemon under test
gets (state dir, socket, roots, config file). Starts nothing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The settle time of a root `write_layout` renders: a "never happens" check waits past it.
SETTLE, SETTLE_S = "300ms", 0.3


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_config(daemon: dict[str, Any], roots: list[dict[str, Any]]) -> str:
    """A TOML config from plain dicts (nested dicts in a root become sub-tables)."""
    lines = ["[daemon]"] + [f"{k} = {toml_value(v)}" for k, v in daemon.items()]
    for r in roots:
        lines += ["", "[[roots]]"]
        lines += [f"{k} = {toml_value(v)}" for k, v in r.items() if not isinstance(v, dict)]
        for k, sub in r.items():
            if isinstance(sub, dict):
                lines += _subtable(f"roots.{k}", sub)
    return "\n".join(lines) + "\n"


def _subtable(name: str, d: dict[str, Any]) -> list[str]:
    lines = ["", f"[{name}]"]
    lines += [f"{k} = {toml_value(v)}" for k, v in d.items() if not isinstance(v, dict)]
    for k, sub in d.items():
        if isinstance(sub, dict):
            lines += _subtable(f"{name}.{k}", sub)
    return lines


@dataclass(frozen=True)
class Layout:
    """Where a daemon under test keeps everything, and the config file that says so."""

    base: Path
    config: Path
    socket: Path
    state_dir: Path
    roots: dict[str, Path]


def without_disk_floor(root: dict[str, Any]) -> dict[str, Any]:
    """`root` with `retention.local.min_free = "0"` unless it sets its own: the default (10 %
    of the file system) makes retention delete beyond its rules on a host disk that is more
    than 90 % full, so a test of anything else must not inherit it from the machine it runs
    on. Tests of the floor set it (or a fake disk) themselves."""
    root = dict(root)
    retention = dict(root.get("retention", {}))
    local = dict(retention.get("local", {}))
    local.setdefault("min_free", "0")
    retention["local"] = local
    root["retention"] = retention
    return root


def write_layout(base: Path, sock: Path, roots: list[dict[str, Any]] | None = None,
                 **daemon_keys: Any) -> Layout:
    """Create the roots (under `base/roots/<name>` unless a root gives `path`) and write
    `base/ckptd.toml`: 1s scans, 300ms settle, JSON debug logs, no free-space floor
    (`without_disk_floor`) unless overridden."""
    roots = roots if roots is not None else [{"name": "r1"}]
    root_paths: dict[str, Path] = {}
    rendered = []
    for r in roots:
        r = without_disk_floor(r)
        path = Path(r.pop("path", base / "roots" / r["name"]))
        path.mkdir(parents=True, exist_ok=True)
        root_paths[r["name"]] = path
        rendered.append({"name": r.pop("name"), "path": str(path),
                         "settle": r.pop("settle", SETTLE), **r})
    state_dir = base / "state"
    daemon = {"state_dir": str(state_dir), "socket": str(sock), "scan_interval": "1s",
              "log_format": "json", "log_level": "debug", **daemon_keys}
    config = base / "ckptd.toml"
    config.write_text(render_config(daemon, rendered))
    return Layout(base, config, sock, state_dir, root_paths)


def root_table(name: str, path: Path, settle: str = "300ms") -> str:
    """A `[[roots]]` table to append to a rendered config (a root added before a reload)."""
    return f'\n[[roots]]\nname = "{name}"\npath = "{path}"\nsettle = "{settle}"\n'
