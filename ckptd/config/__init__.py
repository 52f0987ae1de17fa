"""The configuration: the schema (`schema`: frozen pydantic models of the TOML), the loader
(`load`), the field types (`fields`), the error sentences (`errors`) and the [daemon] keys
from the environment (`env`). Import from here.
"""

from ckptd.config.fields import (
    DEFAULT_SOCKET_PATH,
    check_trusted_globals,
    node_of_host,
    render_toml,
)
from ckptd.config.load import (
    DEFAULT_CONFIG_PATH,
    check_installed,
    find_config,
    load_config,
    parse_config,
)
from ckptd.config.schema import (
    CodecConfig,
    Config,
    DaemonConfig,
    LocalRetention,
    MemoryConfig,
    MetricsConfig,
    RemoteRetention,
    RetentionConfig,
    RootConfig,
    UploadConfig,
    needs_restart,
)
from ckptd.units import FreeSpace

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "find_config",
    "DEFAULT_SOCKET_PATH",
    "CodecConfig",
    "Config",
    "DaemonConfig",
    "FreeSpace",
    "LocalRetention",
    "MemoryConfig",
    "MetricsConfig",
    "RemoteRetention",
    "RetentionConfig",
    "RootConfig",
    "UploadConfig",
    "load_config",
    "check_installed",
    "check_trusted_globals",
    "needs_restart",
    "node_of_host",
    "parse_config",
    "render_toml",
]
