"""Loading the configuration: read the TOML file (bounded), merge [defaults] into each [[roots]]
entry, resolve paths (a root's through its links: the one place a root link is followed), check
overlaps, and turn every problem into one sentence naming its key.
Reads only the config file; never creates, opens or watches anything.
"""


from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar, cast

from ckptd import needs_torch, torch_version
from ckptd.config.env import overlay, variable
from ckptd.config.errors import _key_path, _unknown_key, _validate
from ckptd.config.fields import (
    _show,
)
from ckptd.config.schema import (
    Config,
    DaemonConfig,
    MemoryConfig,
    MetricsConfig,
    RootConfig,
    _Model,
)
from ckptd.errors import ConfigError

DEFAULT_CONFIG_PATH = Path("/etc/ckptd/ckptd.toml")
LOCAL_CONFIG_NAME = "ckptd.toml"


def find_config(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """The config every command and library call uses, found the way the daemon's is: the
    explicit path, else $CKPTD_CONFIG, else /etc/ckptd/ckptd.toml, else ./ckptd.toml."""
    chosen = explicit or os.environ.get("CKPTD_CONFIG")
    if chosen:
        return Path(chosen)
    for candidate in (DEFAULT_CONFIG_PATH, Path.cwd() / LOCAL_CONFIG_NAME):
        if candidate.is_file():
            return candidate
    return None
# --- the schema -----------------------------------------------------------------------------------



_M = TypeVar("_M", bound=_Model)
_TOP_KEYS = ("daemon", "metrics", "memory", "defaults", "roots")
_ROOT_ONLY = ("name", "path")


MAX_CONFIG_BYTES = 1024 * 1024


def load_config(path: Path, env: Mapping[str, str] | None = None) -> Config:
    """Read and validate a TOML config file; any problem raises ConfigError naming the file.
    `env` (os.environ unless given) overrides [daemon] keys: CKPTD_<KEY> (`config.env`)."""
    path = Path(path)
    data = _read_toml(path)
    return parse_config(data, path.absolute().parent, source=str(path),
                        env=os.environ if env is None else env)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: over {MAX_CONFIG_BYTES} bytes, not a ckptd config")
        return tomllib.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (bad byte at offset {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(_toml_syntax_message(path, str(e))) from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a ckptd config") from None


def _toml_syntax_message(path: Path, message: str) -> str:
    match = re.search(r"\s*\(at line (\d+), column (\d+)\)$", message)
    if match is None:
        return f"{path}: not valid TOML: {message}"
    line, column = match.groups()
    return f"{path}, line {line}, column {column}: not valid TOML: {message[: match.start()]}"


def parse_config(data: Mapping[str, Any], base_dir: Path, *, source: str = "config",
                 env: Mapping[str, str] | None = None) -> Config:
    """Validate TOML data; relative paths count from `base_dir`. Collects every problem.
    `env`'s CKPTD_<KEY> variables override the [daemon] table's keys."""
    problems: list[str] = []
    context = {"base_dir": Path(base_dir).absolute()}
    problems += [_unknown_key(key, key, _TOP_KEYS) for key in data if key not in _TOP_KEYS]
    daemon = _daemon(data, env or {}, context, problems)
    metrics = _section("metrics", MetricsConfig, data, context, problems)
    memory = _section("memory", MemoryConfig, data, context, problems)
    if memory is not None and memory.secret_file:  # relative to the config file, as paths are
        memory = memory.model_copy(update={"secret_file": str(
            context["base_dir"] / Path(memory.secret_file).expanduser())})
    defaults = _table(data, "defaults", problems)
    _check_defaults(defaults, context, problems)
    defaults = {key: value for key, value in defaults.items() if key not in _ROOT_ONLY}
    roots = _roots(data, defaults, context, problems)
    problems += _overlaps(daemon.state_dir if daemon else None, roots)
    if daemon is None or metrics is None or memory is None or problems:
        raise ConfigError(_summary(source, problems))
    return Config(daemon=daemon, metrics=metrics, memory=memory,
                  roots=tuple(r for r in roots.values() if r.path.name != "*"),
                  globs=tuple(r for r in roots.values() if r.path.name == "*"))


def check_installed(cfg: Config, source: str = "config") -> None:
    """Raise ConfigError when this install cannot run what a valid config asks for: a root's
    `deep_validate = true` without PyTorch (the slim `pip install ckptd`). The daemon (start,
    reload) and `ckptd config check` ask this; commands that only read the config do not, so
    a slim install still finds the socket and restores from a daemon's config that uses it."""
    if torch_version() is not None:
        return
    problems = [needs_torch(f"roots[{i}].deep_validate = true")
                for i, root in enumerate(cfg.roots) if root.deep_validate]
    problems += [needs_torch(f'the roots of "{glob.name}" ({glob.path}): deep_validate = true')
                 for glob in cfg.globs if glob.deep_validate]
    if problems:
        raise ConfigError(_summary(source, problems))


def _summary(source: str, problems: list[str]) -> str:
    if len(problems) == 1:
        return f"{source}: {problems[0]}"
    lines = "\n".join(f"  {problem}" for problem in problems)
    return f"{source}: {len(problems)} problems:\n{lines}"


def _table(data: Mapping[str, Any], key: str, problems: list[str]) -> dict[str, Any]:
    value = data.get(key, {})
    if isinstance(value, dict):
        return value
    problems.append(f"{key}: must be a table, got {_show(value)}")
    return {}


def _section(
    key: str, model: type[_M], data: Mapping[str, Any], context: dict[str, Any],
    problems: list[str],
) -> _M | None:  # fmt: skip
    raw = _table(data, key, problems)
    instance, errors = _validate(model, raw, context)
    problems += [f"{_key_path(key, loc)}: {sentence}" for loc, sentence in errors]
    return instance


def _daemon(data: Mapping[str, Any], env: Mapping[str, str], context: dict[str, Any],
            problems: list[str]) -> DaemonConfig | None:
    table, from_env = overlay(_table(data, "daemon", problems), env)
    instance, errors = _validate(DaemonConfig, table, context)
    for loc, sentence in errors:
        key = _key_path("daemon", loc)
        named = f"{variable(str(loc[0]))} ({key})" if loc and loc[0] in from_env else key
        problems.append(f"{named}: {sentence}")
    return instance


def _check_defaults(defaults: dict[str, Any], context: dict[str, Any], problems: list[str]) -> None:
    for key in _ROOT_ONLY:
        if key in defaults:
            problems.append(f"defaults.{key}: cannot be a default; set it in each [[roots]] entry")
    # name and path are required per root; stand-ins let the rest of [defaults] be checked alone.
    stand_in = {**defaults, "name": "defaults", "path": "/"}
    _, errors = _validate(RootConfig, stand_in, context)
    problems += [f"{_key_path('defaults', loc)}: {sentence}" for loc, sentence in errors]


def _roots(
    data: Mapping[str, Any], defaults: dict[str, Any], context: dict[str, Any],
    problems: list[str],
) -> dict[int, RootConfig]:  # fmt: skip
    """The valid [[roots]] entries by their index in the file, so later checks can name them."""
    raw_roots = data.get("roots", [])
    if not isinstance(raw_roots, list):
        problems.append(f"roots: must be a list of [[roots]] tables, got {_show(raw_roots)}")
        return {}
    roots = {}
    for i, raw in enumerate(raw_roots):
        if not isinstance(raw, dict):
            problems.append(f"roots[{i}]: must be a table, got {_show(raw)}")
            continue
        root, errors = _validate(RootConfig, _merge(defaults, raw), context)
        # A bad value inherited from [defaults] is reported once, under defaults.
        problems += [
            f"{_key_path(f'roots[{i}]', loc)}: {sentence}"
            for loc, sentence in errors
            if _has(raw, loc) or not _has(defaults, loc)
        ]
        if root is not None and "*" in root.path.parent.parts:
            problems.append(f"roots[{i}].path: {root.path}: \"*\" may only end a root's path"
                            " (\"/*\": one root per directory under it)")
        elif root is not None:
            roots[i] = _followed(root)
    return roots


def _followed(root: RootConfig) -> RootConfig:
    """The root with its path resolved: a root given as a link (or below one) is followed here,
    once per load (start, each reload), and every component then opens the directory it names
    and never follows a link below it. A path that does not exist yet resolves as far as it
    can; a link made there later is refused by the lease until a reload follows it. A glob's
    directory is followed the same way; the `*` below it never matches a link."""
    if root.path.name == "*":
        return root.model_copy(update={"path": Path(os.path.realpath(root.path.parent)) / "*"})
    return root.model_copy(update={"path": Path(os.path.realpath(root.path))})


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Deep merge of TOML tables: nested tables merge key by key, `over` wins."""
    merged = dict(base)
    for key, value in over.items():
        below = merged.get(key)
        both_tables = isinstance(value, dict) and isinstance(below, dict)
        merged[key] = _merge(cast(dict[str, Any], below), value) if both_tables else value
    return merged


def _has(table: Any, loc: tuple[str | int, ...]) -> bool:
    for part in loc:
        if not isinstance(table, dict) or part not in table:
            return False
        table = table[part]
    return True


def _overlaps(state_dir: Path | None, roots: dict[int, RootConfig]) -> list[str]:
    """Cross-entry checks: unique names; no root, state dir or file remote inside another root."""
    problems = []
    # A glob entry watches its whole directory: nothing else may be inside it.
    real = {i: Path(os.path.realpath(root.path.parent if root.path.name == "*" else root.path))
            for i, root in roots.items()}
    for j, root in roots.items():
        for i, other in roots.items():
            if i >= j:
                break
            if other.name == root.name:
                problems.append(f'roots[{j}].name: "{root.name}" is already the name of roots[{i}]')
            elif _nested(real[i], real[j]):
                problems.append(
                    f"roots[{j}].path: {root.path} overlaps roots[{i}].path ({other.path}); "
                    "one root may not be inside another"
                )
    for i, root in roots.items():
        problems += _outside_root(i, root, real[i], state_dir)
        if root.nodes > 1 and not root.upload.url:
            problems.append(f"roots[{i}].nodes: {root.nodes} nodes share a checkpoint through"
                            " the object store; set roots.upload.url")
    return problems


def _outside_root(i: int, root: RootConfig, real: Path, state_dir: Path | None) -> list[str]:
    """The daemon's state and a file remote must not be watched as checkpoint data."""
    problems = []
    if state_dir is not None and _nested(Path(os.path.realpath(state_dir)), real):
        problems.append(
            f"daemon.state_dir: {state_dir} overlaps roots[{i}].path ({root.path}); "
            "the daemon's state must live outside watched roots"
        )
    remote = root.upload.file_path
    if remote is not None and _nested(Path(os.path.realpath(remote)), real):
        problems.append(
            f"roots[{i}].upload.url: {root.upload.url} overlaps the root's own path "
            f"({root.path}); the remote copy must live outside it"
        )
    return problems


def _nested(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


