"""The configuration's field types: parse config strings (durations, sizes, paths, URLs, node
ids) into plain values, with the words each error sentence uses; and TOML output of plain data.
Pure: reads nothing; `ckptd.config` builds the schema from these.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, cast, get_args
from urllib.parse import urlsplit, urlunsplit

from pydantic import (
    Field,
    PlainValidator,
    ValidationInfo,
)

from ckptd import layouts, model
from ckptd.errors import BadValue
from ckptd.units import (
    FreeSpace,
    format_duration,
    format_size,
    parse_duration,
    parse_free,
    parse_rate,
    parse_size,
)

DEFAULT_SOCKET_PATH = Path("/run/ckptd/ckptd.sock")
# sun_path holds 108 bytes including the terminating NUL.
_SOCKET_PATH_MAX = 107
_ROOT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
# The object-store URL schemes an upload URL may use besides file:, each with how its URL is
# written in error sentences ("" where another's words cover it). `ckptd.backends.register`
# adds a store's scheme here with the backend that opens it.
STORAGE_SCHEMES: dict[str, str] = {
    "s3": "s3://bucket/prefix", "gs": "gs://bucket/prefix", "az": "az://container/prefix",
    "abfs": "abfs://container@account.dfs.core.windows.net/prefix", "abfss": "",
}

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
    raise BadValue(f"must be a path (a non-empty string), got {_show(value)}")


def _socket_path(value: Any, info: ValidationInfo) -> Path:
    path = _path(value, info)
    size = len(os.fsencode(path))
    if size > _SOCKET_PATH_MAX:
        raise BadValue(
            f"{str(path)!r} is {size} bytes long; a Unix socket path may be at most "
            f"{_SOCKET_PATH_MAX}: choose a shorter path"
        )
    return path


def _layout(value: Any) -> str:
    """"auto" or a registered layout's name (`ckptd.layouts.register`)."""
    known = ("auto", *layouts.names())
    if not isinstance(value, str) or value not in known:
        raise BadValue(f"must be one of: {', '.join(known)}, got {_show(value)}")
    return value


def _codec(value: Any) -> str:
    """A known codec's name (`ckptd.model.CODECS`, which `ckptd.codec.register` extends)."""
    if not isinstance(value, str) or value not in model.CODECS:
        raise BadValue(f"must be one of: {', '.join(model.CODECS)}, got {_show(value)}")
    return value


def _duration(value: Any) -> float:
    return parse_duration(cast(str, value))


def _positive_duration(value: Any) -> float:
    seconds = _duration(value)
    if seconds <= 0:
        raise BadValue(f"must be a duration above zero, got {_show(value)}")
    return seconds


def _store_timeout(value: Any) -> float:
    seconds = _duration(value)
    if not 0.1 <= seconds <= 86400:
        raise BadValue(f"must be a duration from 100ms to 24h, got {_show(value)}")
    return seconds


def _lease_timeout(value: Any) -> float:
    seconds = _duration(value)
    if not 2 <= seconds <= 86400:
        raise BadValue(f"must be a duration from 2s to 24h, got {_show(value)}")
    return seconds


def _commit_timeout(value: Any) -> float:
    seconds = _duration(value)
    if not 10 <= seconds <= 7 * 86400:
        raise BadValue(f"must be a duration from 10s to 7d, got {_show(value)}")
    return seconds


def _node(value: Any) -> str:
    if not isinstance(value, str):
        raise BadValue(f"must be a string, got {_show(value)}")
    if value and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", value):
        raise BadValue("must be 1 to 64 letters, digits, '.', '_' or '-' (starting with a"
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
        raise BadValue(f"must be a size above zero, got {_show(value)}")
    return size


def _rate(value: Any) -> int | None:
    return None if value == "" else parse_rate(cast(str, value))


def _free(value: Any) -> FreeSpace:
    return value if isinstance(value, FreeSpace) else parse_free(cast(str, value))


def _root_name(value: str) -> str:
    if not _ROOT_NAME.fullmatch(value):
        raise BadValue(
            f'{_show(value)} is not a usable root name: 1 to 64 letters, digits, ".", "_" or "-", '
            "starting with a letter or digit"
        )
    return value


_GLOBAL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
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
            raise BadValue(f'{_show(name)} is not a "module.Name" global')
        if name.split(".")[0] in _NEVER_TRUSTED or name.split(".")[-1].startswith("__"):
            raise BadValue(f"{_show(name)} can run code or touch the system when unpickled;"
                             " it is never trusted")
    return value


def _listen(value: str) -> str:
    """The one check `config check` and `run` share: IP:PORT, [IPV6]:PORT, localhost:PORT or
    :PORT (every interface). Hosts are IP literals: nothing is looked up in DNS."""
    if not value:
        return value
    address = _split_listen(value)
    if address is None:
        raise BadValue(
            f'{_show(value)} is not an address: use "IP:PORT", e.g. "127.0.0.1:9464",'
            ' "[::1]:9464", or ":PORT" for every interface'
        )
    return value


def _peer_listen(value: str) -> str:
    """`memory.listen` / `memory.advertise`: an address as `_listen` takes, or port 0 (an
    ephemeral port, advertised as bound: for tests and single-host jobs)."""
    if not value:
        return value
    if _split_listen(value, any_port=True) is None:
        raise BadValue(
            f'{_show(value)} is not an address: use "IP:PORT", e.g. "10.0.0.5:9465",'
            ' "[::1]:9465", or ":PORT" for every interface'
        )
    return value


def _split_listen(value: str, any_port: bool = False) -> tuple[str, int] | None:
    host, sep, port = value.rpartition(":")
    low = 0 if any_port else 1
    if not sep or not (port.isascii() and port.isdigit()) or not low <= int(port) < 65536:
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
        raise BadValue(f'{_show(value)} is not an endpoint URL: use "https://host[:port]"')
    return value.rstrip("/")


def _upload_url(value: str, info: ValidationInfo) -> str:
    """Checks the scheme; a file URL becomes absolute, a bucket URL loses its trailing slash."""
    if value == "":
        return ""
    if value.startswith("file:"):
        return _file_url(value, info)
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in STORAGE_SCHEMES:
        forms = [form for form in STORAGE_SCHEMES.values() if form]
        raise BadValue(
            f"{_show(value)} is not a supported URL: use {', '.join(forms)}, "
            "file:///absolute/dir or file:relative/dir"
        )
    if not rest.split("/", 1)[0]:
        raise BadValue(f"{_show(value)} names no bucket: use {scheme}://bucket/prefix")
    return f"{scheme}://{rest.rstrip('/')}"


def _file_url(value: str, info: ValidationInfo) -> str:
    rest = value[len("file:") :]
    if rest.startswith("//"):
        host, slash, path = rest[2:].partition("/")
        if host not in ("", "localhost"):
            raise BadValue(
                f'{_show(value)} names a host ("{host}"): use file:///absolute/dir or '
                "file:relative/dir"
            )
        rest = slash + path
    if not rest:
        raise BadValue(f"{_show(value)} names no directory")
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
Attempts = Annotated[int, Field(ge=1, le=100), Expect("a whole number from 1 to 100")]
Flag = Annotated[bool, Expect("true or false")]
Text = Annotated[str, Expect("a string")]
ConfigPath = Annotated[Path, PlainValidator(_path), Render(str)]
SocketPath = Annotated[Path, PlainValidator(_socket_path), Render(str)]
Duration = Annotated[float, PlainValidator(_duration), Render(format_duration)]
PositiveDuration = Annotated[float, PlainValidator(_positive_duration), Render(format_duration)]
StoreTimeout = Annotated[float, PlainValidator(_store_timeout), Render(format_duration)]
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
LayoutName = Annotated[str, PlainValidator(_layout)]
CodecName = Annotated[str, PlainValidator(_codec)]


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
