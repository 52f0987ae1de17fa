"""The configuration: frozen pydantic models of the TOML schema (config.example.toml documents
every key), and the loader that builds them.

Owns defaults, merging [defaults] into each [[roots]] entry, path resolution and error sentences
that name each bad key's path. Reads only the config file; never creates, opens or watches anything.
"""

from __future__ import annotations

import datetime as dt
import difflib
import hashlib
import ipaddress
import json
import math
import os
import re
import socket
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, cast, get_args
from urllib.parse import urlsplit, urlunsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from ckptd.errors import ConfigError, NotFound
from ckptd.model import RootOptions
from ckptd.units import (
    FreeSpace,
    format_duration,
    format_size,
    parse_duration,
    parse_free,
    parse_rate,
    parse_size,
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
DEFAULT_SOCKET_PATH = Path("/run/ckptd/ckptd.sock")
# sun_path holds 108 bytes including the terminating NUL.
_SOCKET_PATH_MAX = 107
_ROOT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_REMOTE_SCHEMES = ("s3", "gs", "az")

Layout = Literal[
    "auto", "native", "registered", "dcp", "split", "ranked",
    "hf", "deepspeed", "megatron", "orbax", "single",
]  # fmt: skip
LAYOUT_NAMES: tuple[str, ...] = get_args(Layout)[1:]
Codec = Literal["auto", "zstd", "zstd-bytegroup", "none"]
MetricMode = Literal["min", "max"]
LogFormat = Literal["auto", "json", "console"]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]


class Expect:
    """What a field wants, in words, for error sentences: "a whole number >= 0"."""

    def __init__(self, words: str) -> None:
        self.words = words


class Render:
    """How a parsed value is written back as TOML in `Config.redacted()`."""

    def __init__(self, render: Callable[[Any], Any]) -> None:
        self.render = render


def _one_of(choices: Any) -> Expect:
    return Expect("one of: " + ", ".join(get_args(choices)))


# --- field types: parse config strings into plain values -----------------------------------------


def _base_dir(info: ValidationInfo) -> Path:
    context = info.context if isinstance(info.context, dict) else {}
    base = context.get("base_dir")
    return Path(base) if base is not None else Path.cwd()


def _resolve(path: Path, info: ValidationInfo) -> Path:
    """Absolute and normalised; relative paths count from the config file's directory."""
    path = path.expanduser()
    if not path.is_absolute():
        path = _base_dir(info) / path
    return Path(os.path.normpath(path))


def _path(value: Any, info: ValidationInfo) -> Path:
    if isinstance(value, Path) or (isinstance(value, str) and value):
        return _resolve(Path(value), info)
    raise ValueError(f"must be a path (a non-empty string), got {_show(value)}")


def _socket_path(value: Any, info: ValidationInfo) -> Path:
    path = _path(value, info)
    size = len(os.fsencode(path))
    if size > _SOCKET_PATH_MAX:
        raise ValueError(
            f"{str(path)!r} is {size} bytes long; a Unix socket path may be at most "
            f"{_SOCKET_PATH_MAX}: choose a shorter path"
        )
    return path


def _duration(value: Any) -> float:
    return parse_duration(cast(str, value))


def _positive_duration(value: Any) -> float:
    seconds = _duration(value)
    if seconds <= 0:
        raise ValueError(f"must be a duration above zero, got {_show(value)}")
    return seconds


def _lease_timeout(value: Any) -> float:
    seconds = _duration(value)
    if not 2 <= seconds <= 86400:
        raise ValueError(f"must be a duration from 2s to 24h, got {_show(value)}")
    return seconds


def _commit_timeout(value: Any) -> float:
    seconds = _duration(value)
    if not 10 <= seconds <= 7 * 86400:
        raise ValueError(f"must be a duration from 10s to 7d, got {_show(value)}")
    return seconds


def _node(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"must be a string, got {_show(value)}")
    if value and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", value):
        raise ValueError("must be 1 to 64 letters, digits, '.', '_' or '-' (starting with a"
                         f" letter or digit), or \"\" for the hostname; got {_show(value)}")
    return value


def node_of_host(host: str) -> str:
    """A hostname as a node id (1 to 64 of `[A-Za-z0-9._-]`, starting with a letter or digit):
    other characters become `-`; a longer name keeps 53 characters and a hash of the whole."""
    node = re.sub(r"[^A-Za-z0-9._-]", "-", host).lstrip("._-") or "node"
    if len(node) > 64:
        digest = hashlib.blake2b(host.encode(errors="replace"), digest_size=5).hexdigest()
        node = f"{node[:53]}-{digest}"
    return node


def _optional_duration(value: Any) -> float | None:
    return None if value == "" else _duration(value)


def _part_size(value: Any) -> int:
    size = parse_size(cast(str, value))
    if size <= 0:
        raise ValueError(f"must be a size above zero, got {_show(value)}")
    return size


def _rate(value: Any) -> int | None:
    return None if value == "" else parse_rate(cast(str, value))


def _free(value: Any) -> FreeSpace:
    return value if isinstance(value, FreeSpace) else parse_free(cast(str, value))


def _root_name(value: str) -> str:
    if not _ROOT_NAME.fullmatch(value):
        raise ValueError(
            f'{_show(value)} is not a usable root name: 1 to 64 letters, digits, ".", "_" or "-", '
            "starting with a letter or digit"
        )
    return value


_GLOBAL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
# Modules whose globals can run code or touch the system when a pickle calls them: never
# trusted, whatever a config says.
# Modules whose globals can run code, start processes, or touch files, the network or the
# interpreter when a pickle calls them: never trusted, whatever the config says.
_NEVER_TRUSTED = frozenset({
    "builtins", "__builtin__", "os", "posix", "nt", "posixpath", "ntpath", "sys", "subprocess",
    "_posixsubprocess", "importlib", "imp", "zipimport", "runpy", "pickle", "_pickle",
    "copyreg", "shelve", "marshal", "shutil", "tempfile", "glob", "pathlib", "io", "_io",
    "codecs", "socket", "ssl", "select", "selectors", "asyncio", "http", "urllib", "ftplib",
    "smtplib", "xmlrpc", "webbrowser", "code", "codeop", "pdb", "bdb", "timeit", "trace",
    "profile", "cProfile", "doctest", "unittest", "ctypes", "cffi", "operator", "functools",
    "itertools", "types", "inspect", "gc", "weakref", "threading", "_thread",
    "multiprocessing", "concurrent", "signal", "pty", "tty", "resource", "fcntl", "mmap",
    "sqlite3", "dbm", "site", "sysconfig", "setuptools", "distutils", "pip", "torch",
})


def check_trusted_globals(value: list[str]) -> list[str]:
    for name in value:
        if not _GLOBAL_NAME.fullmatch(name):
            raise ValueError(f'{_show(name)} is not a "module.Name" global')
        if name.split(".")[0] in _NEVER_TRUSTED or name.split(".")[-1].startswith("__"):
            raise ValueError(f"{_show(name)} can run code or touch the system when unpickled;"
                             " it is never trusted")
    return value


def _listen(value: str) -> str:
    """The one check `config check` and `run` share: IP:PORT, [IPV6]:PORT, localhost:PORT or
    :PORT (every interface). Hosts are IP literals: nothing is looked up in DNS."""
    if not value:
        return value
    address = _split_listen(value)
    if address is None:
        raise ValueError(
            f'{_show(value)} is not an address: use "IP:PORT", e.g. "127.0.0.1:9464",'
            ' "[::1]:9464", or ":PORT" for every interface'
        )
    return value


def _split_listen(value: str) -> tuple[str, int] | None:
    host, sep, port = value.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        host = "127.0.0.1"
    if host:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return None
    return host, int(port)


def _endpoint(value: str) -> str:
    if value and urlsplit(value).scheme not in ("http", "https"):
        raise ValueError(f'{_show(value)} is not an endpoint URL: use "https://host[:port]"')
    return value.rstrip("/")


def _upload_url(value: str, info: ValidationInfo) -> str:
    """Checks the scheme; a file URL becomes absolute, a bucket URL loses its trailing slash."""
    if value == "":
        return ""
    if value.startswith("file:"):
        return _file_url(value, info)
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in _REMOTE_SCHEMES:
        raise ValueError(
            f"{_show(value)} is not a supported URL: use s3://bucket/prefix, gs://bucket/prefix, "
            "az://container/prefix, file:///absolute/dir or file:relative/dir"
        )
    if not rest.split("/", 1)[0]:
        raise ValueError(f"{_show(value)} names no bucket: use {scheme}://bucket/prefix")
    return f"{scheme}://{rest.rstrip('/')}"


def _file_url(value: str, info: ValidationInfo) -> str:
    rest = value[len("file:") :]
    if rest.startswith("//"):
        host, slash, path = rest[2:].partition("/")
        if host not in ("", "localhost"):
            raise ValueError(
                f'{_show(value)} names a host ("{host}"): use file:///absolute/dir or '
                "file:relative/dir"
            )
        rest = slash + path
    if not rest:
        raise ValueError(f"{_show(value)} names no directory")
    return "file://" + _resolve(Path(rest), info).as_posix()


def _redact_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


# Every number has an upper bound too: `workers = 1e8` is a typo, not a request.
Count = Annotated[int, Field(ge=0, le=10**9), Expect("a whole number from 0 to 10^9")]
Threads = Annotated[int, Field(ge=1, le=64), Expect("a whole number from 1 to 64")]
Requests = Annotated[int, Field(ge=1, le=256), Expect("a whole number from 1 to 256")]
Flag = Annotated[bool, Expect("true or false")]
Text = Annotated[str, Expect("a string")]
ConfigPath = Annotated[Path, PlainValidator(_path), Render(str)]
SocketPath = Annotated[Path, PlainValidator(_socket_path), Render(str)]
Duration = Annotated[float, PlainValidator(_duration), Render(format_duration)]
PositiveDuration = Annotated[float, PlainValidator(_positive_duration), Render(format_duration)]
OptionalDuration = Annotated[
    float | None,
    PlainValidator(_optional_duration),
    Render(lambda v: "" if v is None else format_duration(v)),
]
PartSize = Annotated[int, PlainValidator(_part_size), Render(lambda v: format_size(v, exact=True))]
Rate = Annotated[
    int | None,
    PlainValidator(_rate),
    Render(lambda v: "" if v is None else format_size(v, exact=True) + "/s"),
]
Free = Annotated[FreeSpace, PlainValidator(_free), Render(str)]


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


# --- pydantic errors -> sentences ----------------------------------------------------------------

_GENERIC_EXPECT = {
    "int_type": "a whole number",
    "int_from_float": "a whole number",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "model_type": "a table",
    "dict_type": "a table",
    "tuple_type": "a list",
    "list_type": "a list",
}


def _validate(
    model: type[_M], raw: dict[str, Any], context: dict[str, Any]
) -> tuple[_M | None, list[tuple[tuple[str | int, ...], str]]]:
    try:
        return model.model_validate(raw, context=context), []
    except ValidationError as e:
        return None, [(tuple(err["loc"]), _sentence(model, err)) for err in e.errors()]


def _sentence(model: type[BaseModel], err: ErrorDetails) -> str:
    loc = tuple(err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = _model_at(model, loc[:-1])
        return _unknown_key("", str(loc[-1]), tuple(parent.model_fields) if parent else ())
    if kind == "missing":
        return "is required"
    if kind == "value_error":
        return str(err.get("ctx", {}).get("error", err["msg"]))
    field = _field_at(model, loc)
    expect = _expected(field, kind)
    if field is not None and field.annotation is SecretStr:
        return f"must be {expect} (the value is secret, so not shown)"
    return f"must be {expect}, got {_show(err['input'])}"


def _expected(field: FieldInfo | None, kind: str) -> str:
    for meta in field.metadata if field is not None else []:
        if isinstance(meta, Expect):
            return meta.words
    return _GENERIC_EXPECT.get(kind, "a valid value")


def _unknown_key(prefix: str, key: str, known: tuple[str, ...]) -> str:
    guess = difflib.get_close_matches(key, known, n=1)
    hint = f' (did you mean "{guess[0]}"?)' if guess else ""
    return f"{prefix}: unknown key{hint}" if prefix else f"unknown key{hint}"


def _model_at(model: type[BaseModel], loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    for part in loc:
        field = model.model_fields.get(str(part))
        inner = field.annotation if field is not None else None
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            return None
        model = inner
    return model


def _field_at(model: type[BaseModel], loc: tuple[str | int, ...]) -> FieldInfo | None:
    parent = _model_at(model, loc[:-1]) if loc else None
    return parent.model_fields.get(str(loc[-1])) if parent is not None else None


def _key_path(prefix: str, loc: tuple[str | int, ...]) -> str:
    parts = [prefix] if prefix else []
    parts += [_toml_key(str(part)) for part in loc]
    return ".".join(parts)


def _show(value: object) -> str:
    """A value as it would look in TOML, shortened, for error sentences."""
    if isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
        return text if len(text) <= 60 else text[:56] + '..."'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dt.date | dt.time):
        return value.isoformat()
    return repr(value)


# --- TOML output ----------------------------------------------------------------------------------


def render_toml(data: Mapping[str, Any]) -> str:
    """TOML text for plain data (tables, arrays of tables, scalars), as `config check` prints."""
    lines: list[str] = []
    _render_table(data, "", lines)
    return "\n".join(lines).strip() + "\n"


def _render_table(table: Mapping[str, Any], prefix: str, lines: list[str]) -> None:
    nested = []
    for key, value in table.items():
        if _is_table(value):
            nested.append((key, value))
        elif value is not None:
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, value in nested:
        name = f"{prefix}.{_toml_key(key)}" if prefix else _toml_key(key)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(value, list):
                lines += ["", f"[[{name}]]"]
            elif not item or not all(_is_table(v) for v in item.values()):
                # A table holding only tables needs no header of its own.
                lines += ["", f"[{name}]"]
            _render_table(item, name, lines)


def _is_table(value: Any) -> bool:
    """A table or a non-empty array of tables: written under a [header], not as `key = value`."""
    if isinstance(value, list):
        return bool(value) and all(isinstance(v, Mapping) for v in value)
    return isinstance(value, Mapping)


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_string(text: str) -> str:
    # JSON's string escapes are valid TOML; DEL is the one control character JSON leaves raw.
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _toml_float(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dt.date | dt.time):
        return value.isoformat()
    return _toml_string(str(value))


def _toml_float(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)
