"""The configuration's schema: frozen pydantic models of the TOML (config.example.toml documents
every key), their defaults and what a reload cannot apply. Reads nothing; `load` builds them.
"""


from __future__ import annotations

import socket
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from ckptd.config.fields import (
    DEFAULT_SOCKET_PATH,
    Attempts,
    CodecName,
    ConfigPath,
    Count,
    Duration,
    Expect,
    Flag,
    Free,
    LayoutName,
    LogFormat,
    LogLevel,
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
    _peer_listen,
    _redact_url,
    _root_name,
    _split_listen,
    _upload_url,
    check_trusted_globals,
    node_of_host,
)
from ckptd.errors import BadValue, NotFound
from ckptd.model import MetricMode, RootOptions
from ckptd.units import (
    FreeSpace,
    format_duration,
)


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


class MemoryConfig(_Model):
    """[memory]: the state kept in memory for a restart, and the copies peers hold
    (docs/MEMORY.md)."""

    keep: Flag = True
    replicas: Annotated[int, Field(ge=0, le=16), Expect("a whole number from 0 to 16")] = 0
    listen: Annotated[str, AfterValidator(_peer_listen), Expect("a string")] = ""
    advertise: Annotated[str, AfterValidator(_peer_listen), Expect("a string")] = ""
    secret_file: Text = ""
    max_bytes: Free = FreeSpace(percent=25.0)
    max_bandwidth: Rate = None
    # A peer that sends nothing for this long is skipped (and one that does not answer).
    timeout: PositiveDuration = 30.0

    @model_validator(mode="after")
    def _peers_need_a_secret(self) -> MemoryConfig:
        if self.replicas > 0 and not self.secret_file:
            raise BadValue("memory.replicas > 0 needs memory.secret_file (the job's shared"
                             " secret every peer request proves)")
        if self.listen and not self.secret_file:
            raise BadValue("memory.listen needs memory.secret_file: peers are answered only"
                             " with the job's shared secret")
        return self

    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) to listen on for peers, or None when this daemon takes no peer
        requests."""
        return _split_listen(self.listen, any_port=True) if self.listen else None

    def cap_bytes(self, ram: int) -> int:
        """`max_bytes` in bytes, given the machine's memory."""
        return self.max_bytes.required(ram)


class CodecConfig(_Model):
    codec: CodecName = "auto"
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
    layout: LayoutName = "auto"
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
    compress: CodecConfig = Field(default_factory=CodecConfig)
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
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    roots: tuple[RootConfig, ...] = ()
    # Entries whose path ends in "/*": one root per directory under it (docs/OPERATIONS.md).
    globs: tuple[RootConfig, ...] = ()

    def root(self, name: str) -> RootConfig:
        """The root named `name`: a configured one, else one a glob entry makes (whether or not
        its directory exists now: a retired job's remote is still read by its root's name)."""
        for root in self.roots:
            if root.name == name:
                return root
        for glob in self.globs:
            directory = name.removeprefix(f"{glob.name}-")
            if directory != name and directory and "/" not in directory \
                    and not directory.startswith("."):
                return glob.model_copy(update={"name": name,
                                               "path": glob.path.parent / directory})
        known = ", ".join(r.name for r in self.roots) or "none"
        raise NotFound(f"no root named {name!r} in the config (configured: {known})")

    def redacted(self) -> dict[str, Any]:
        """The effective config as TOML data: secrets as "***", durations and sizes as strings."""
        return {
            "daemon": _plain(self.daemon),
            "metrics": _plain(self.metrics),
            "memory": _plain(self.memory),
            "roots": [_plain(root) for root in self.roots + self.globs],
        }


# The daemon keys the daemon reads once, at start: the socket and state dir it opened, the
# stage workers it started, the watcher it chose, the logging it set up, and the node id its
# stage workers and retention were built with (the root lease reads the new one).
_READ_AT_START = ("state_dir", "socket", "socket_group", "workers", "polling", "log_format",
                  "log_level", "node")


def needs_restart(old: Config, new: Config) -> list[str]:
    """The keys whose change a reload cannot apply (they take effect at the next start)."""
    keys = [f"daemon.{k}" for k in _READ_AT_START
            if getattr(old.daemon, k) != getattr(new.daemon, k)]
    keys += [f"memory.{k}" for k in ("listen", "advertise", "secret_file", "replicas",
                                      "max_bytes", "max_bandwidth", "timeout")
             if getattr(old.memory, k) != getattr(new.memory, k)]
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
