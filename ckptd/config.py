"""The configuration: frozen pydantic models of the TOML schema (config.example.toml documents
every key), and the loader that builds them.

Owns defaults, merging [defaults] into each [[roots]] entry, path resolution and error sentences
that name each bad key's path (field types in `config_fields`, the sentences in `config_errors`).
Reads only the config file; never creates, opens or watches anything.
"""

from __future__ import annotations

import os
import re
import socket
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar, cast

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    SecretStr,
    ValidationInfo,
    field_validator,
)
from pydantic.fields import FieldInfo

from ckptd.config_errors import _key_path, _unknown_key, _validate
from ckptd.config_fields import (
    DEFAULT_SOCKET_PATH,
    LAYOUT_NAMES,
    Attempts,
    Codec,
    ConfigPath,
    Count,
    Duration,
    Expect,
    Flag,
    Free,
    Layout,
    LogFormat,
    LogLevel,
    MetricMode,
    OptionalDuration,
    PartSize,
    PositiveDuration,
    Rate,
    Render,
    Requests,
    SocketPath,
    StoreTimeout,
    Text,
    Threads,
    _commit_timeout,
    _endpoint,
    _lease_timeout,
    _listen,
    _node,
    _one_of,
    _redact_url,
    _root_name,
    _show,
    _split_listen,
    _upload_url,
    check_trusted_globals,
    node_of_host,
    render_toml,
)
from ckptd.errors import ConfigError, NotFound
from ckptd.model import RootOptions
from ckptd.units import (
    FreeSpace,
    format_duration,
)

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "find_config",
    "DEFAULT_SOCKET_PATH",
    "LAYOUT_NAMES",
    "CompressConfig",
    "Config",
    "DaemonConfig",
    "FreeSpace",
    "LocalRetention",
    "MetricsConfig",
    "RemoteRetention",
    "RetentionConfig",
    "RootConfig",
    "UploadConfig",
    "load_config",
    "check_trusted_globals",
    "needs_restart",
    "node_of_host",
    "parse_config",
    "render_toml",
]

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


class _Model(BaseModel):
    # strict: a TOML "2" is not 2 and 1 is not true; nothing is coerced behind the user's back.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class DaemonConfig(_Model):
    """[daemon]: where the daemon keeps its state and listens, and how it runs."""

    state_dir: ConfigPath = Path("/var/lib/ckptd")
    socket: SocketPath = DEFAULT_SOCKET_PATH
    socket_group: Text = ""
    workers: Threads = 2
    scan_interval: PositiveDuration = 30.0
    polling: Flag = False
    log_format: Annotated[LogFormat, _one_of(LogFormat)] = "auto"
    log_level: Annotated[LogLevel, _one_of(LogLevel)] = "info"
    node: Annotated[str, PlainValidator(_node)] = ""
    lease_timeout: Annotated[float, PlainValidator(_lease_timeout),
                             Render(format_duration)] = 30.0

    @property
    def node_id(self) -> str:
        """This node's id: `node`, else the hostname as a node id (see `node_of_host`)."""
        return self.node or node_of_host(socket.gethostname())


class MetricsConfig(_Model):
    """[metrics]: an optional TCP listener for /metrics only."""

    listen: Annotated[str, AfterValidator(_listen), Expect("a string")] = ""

    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) to listen on, or None when /metrics is served on the socket only."""
        return _split_listen(self.listen) if self.listen else None


class CompressConfig(_Model):
    codec: Annotated[Codec, _one_of(Codec)] = "auto"
    level: Annotated[int, Field(ge=1, le=22), Expect("a whole number from 1 to 22")] = 3
    threads: Threads = 1
    min_saving: Annotated[float, Field(ge=0, lt=1), Expect("a number from 0 to below 1")] = 0.03


class UploadConfig(_Model):
    url: Annotated[str, Expect("a string")] = ""
    endpoint: Annotated[str, AfterValidator(_endpoint), Expect("a string")] = ""
    region: Text = ""
    access_key_id: Text = ""
    secret_access_key: Annotated[SecretStr, Expect("a string")] = SecretStr("")
    concurrency: Requests = 4
    part_size: PartSize = 64 * 1024**2
    max_bandwidth: Rate = None
    # How long a stalled store may hold a transfer: no byte for read_timeout (downloads, HEAD,
    # LIST, DELETE), one request past request_timeout, each retried `retries` times in all.
    connect_timeout: StoreTimeout = 10.0
    read_timeout: StoreTimeout = 60.0
    request_timeout: StoreTimeout = 600.0
    attempts: Attempts = 5

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str, info: ValidationInfo) -> str:
        return _upload_url(value, info)

    @property
    def enabled(self) -> bool:
        return self.url != ""

    @property
    def file_path(self) -> Path | None:
        """The directory of a file:// URL (taken literally, no %-decoding), else None."""
        if not self.url.startswith("file://"):
            return None
        return Path(self.url[len("file://") :])


class LocalRetention(_Model):
    keep_last: Count = 2
    keep_best: Count = 1
    keep_every: Count = 0
    keep_within: OptionalDuration = None
    compress_older: Flag = False
    min_free: Free = FreeSpace(percent=10.0)
    delete_invalid: Flag = False


class RemoteRetention(_Model):
    keep_last: Count = 10
    keep_best: Count = 3
    keep_every: Count = 5000
    keep_within: OptionalDuration = 30 * 86400.0


class RetentionConfig(_Model):
    local: LocalRetention = Field(default_factory=LocalRetention)
    remote: RemoteRetention = Field(default_factory=RemoteRetention)


class RootConfig(_Model):
    """One [[roots]] entry, with [defaults] already merged under it."""

    name: Annotated[str, AfterValidator(_root_name), Expect("a string")]
    path: ConfigPath
    layout: Annotated[Layout, _one_of(Layout)] = "auto"
    settle: Duration = 5.0
    # A save still incomplete this long after its files last changed is given up: invalid,
    # with the reason its layout names (a file never written, a shard short of its bytes).
    pending_timeout: Duration = 3600.0
    world_size: Count = 0
    # How many nodes write each checkpoint (docs/MULTINODE.md); 1 = this node alone.
    nodes: Annotated[int, Field(ge=1, le=100_000), Expect("a whole number from 1 to 100000")] = 1
    # After this long since a step's newest part, any node may commit it (else the coordinator).
    commit_timeout: Annotated[float, PlainValidator(_commit_timeout),
                              Render(format_duration)] = 600.0
    deep_validate: Flag = False
    # Globals (besides torch's weights-only set) a framework pickles into its checkpoints,
    # e.g. Megatron's "argparse.Namespace": referenced, never executed by ckptd.
    trusted_globals: Annotated[list[str], AfterValidator(check_trusted_globals),
                               Expect('a list of "module.Name" strings')] = []  # noqa: RUF012
    metric: Text = ""
    metric_mode: Annotated[MetricMode, _one_of(MetricMode)] = "min"
    compress: CompressConfig = Field(default_factory=CompressConfig)
    upload: UploadConfig = Field(default_factory=UploadConfig)
    retention: RetentionConfig = Field(default_factory=RetentionConfig)

    @property
    def options(self) -> RootOptions:
        """The slice of this root's settings that completion rules need."""
        return RootOptions(settle=self.settle, world_size=self.world_size,
                           multi_node=self.nodes > 1)

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1


class Config(_Model):
    daemon: DaemonConfig = Field(default_factory=DaemonConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    roots: tuple[RootConfig, ...] = ()

    def root(self, name: str) -> RootConfig:
        for root in self.roots:
            if root.name == name:
                return root
        known = ", ".join(r.name for r in self.roots) or "none"
        raise NotFound(f"no root named {name!r} in the config (configured: {known})")

    def redacted(self) -> dict[str, Any]:
        """The effective config as TOML data: secrets as "***", durations and sizes as strings."""
        return {
            "daemon": _plain(self.daemon),
            "metrics": _plain(self.metrics),
            "roots": [_plain(root) for root in self.roots],
        }


def needs_restart(old: Config, new: Config) -> list[str]:
    """The keys whose change a reload cannot apply (they take effect at the next start)."""
    keys = [f"daemon.{k}" for k in ("state_dir", "socket", "socket_group")
            if getattr(old.daemon, k) != getattr(new.daemon, k)]
    return keys + (["metrics.listen"] if old.metrics != new.metrics else [])


def _plain(model: BaseModel) -> dict[str, Any]:
    return {
        name: _plain_value(getattr(model, name), field)
        for name, field in type(model).model_fields.items()
    }


def _plain_value(value: Any, field: FieldInfo) -> Any:
    if isinstance(value, BaseModel):
        return _plain(value)
    if isinstance(value, SecretStr):
        return "***" if value.get_secret_value() else ""
    for meta in field.metadata:
        if isinstance(meta, Render):
            return meta.render(value)
    if isinstance(value, str) and "://" in value:
        return _redact_url(value)
    return value


# --- loading --------------------------------------------------------------------------------------

_M = TypeVar("_M", bound=_Model)
_TOP_KEYS = ("daemon", "metrics", "defaults", "roots")
_ROOT_ONLY = ("name", "path")


MAX_CONFIG_BYTES = 1024 * 1024


def load_config(path: Path) -> Config:
    """Read and validate a TOML config file; any problem raises ConfigError naming the file."""
    path = Path(path)
    data = _read_toml(path)
    return parse_config(data, path.absolute().parent, source=str(path))


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


def parse_config(data: Mapping[str, Any], base_dir: Path, *, source: str = "config") -> Config:
    """Validate TOML data; relative paths count from `base_dir`. Collects every problem."""
    problems: list[str] = []
    context = {"base_dir": Path(base_dir).absolute()}
    problems += [_unknown_key(key, key, _TOP_KEYS) for key in data if key not in _TOP_KEYS]
    daemon = _section("daemon", DaemonConfig, data, context, problems)
    metrics = _section("metrics", MetricsConfig, data, context, problems)
    defaults = _table(data, "defaults", problems)
    _check_defaults(defaults, context, problems)
    defaults = {key: value for key, value in defaults.items() if key not in _ROOT_ONLY}
    roots = _roots(data, defaults, context, problems)
    problems += _overlaps(daemon.state_dir if daemon else None, roots)
    if daemon is None or metrics is None or problems:
        raise ConfigError(_summary(source, problems))
    return Config(daemon=daemon, metrics=metrics, roots=tuple(roots.values()))


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
        if root is not None:
            roots[i] = root
    return roots


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
    real = {i: Path(os.path.realpath(root.path)) for i, root in roots.items()}
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


