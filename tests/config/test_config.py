"""The config loader on real TOML files: defaults, merging, units, paths, and error sentences."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from ckptd import layouts
from ckptd.config import (
    DEFAULT_CONFIG_PATH,
    Config,
    DaemonConfig,
    FreeSpace,
    MetricsConfig,
    RootConfig,
    load_config,
    parse_config,
    render_toml,
)
from ckptd.errors import ConfigError, NotFound

REPO = Path(__file__).resolve().parents[2]
MiB = 1024**2

MINIMAL_ROOT = """
[[roots]]
name = "llm"
path = "ckpt/llm"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ckptd.toml"
    path.write_text(text)
    return path


def load(tmp_path: Path, text: str) -> Config:
    return load_config(write(tmp_path, text))


def problems(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, text)
    return str(caught.value)


# --- defaults ---------------------------------------------------------------------------------


def test_empty_file_gives_spec_defaults(tmp_path: Path) -> None:
    config = load(tmp_path, "")
    daemon = config.daemon
    assert daemon.state_dir == Path("/var/lib/ckptd")
    assert daemon.socket == Path("/run/ckptd/ckptd.sock")
    assert daemon.socket_group == ""
    assert daemon.workers == 2
    assert daemon.scan_interval == 30.0
    assert daemon.polling is False
    assert daemon.log_format == "auto"
    assert daemon.log_level == "info"
    assert config.metrics.listen == ""
    assert config.metrics.address is None
    assert config.roots == ()
    assert DEFAULT_CONFIG_PATH == Path("/etc/ckptd/ckptd.toml")


def test_root_defaults_equal_spec(tmp_path: Path) -> None:
    root = load(tmp_path, MINIMAL_ROOT).root("llm")
    assert root.layout == "auto"
    assert root.settle == 5.0
    assert root.world_size == 0
    assert root.deep_validate is False
    assert (root.metric, root.metric_mode) == ("", "min")
    c = root.compress
    assert (c.codec, c.level, c.threads, c.min_saving) == ("auto", 3, 1, 0.03)
    u = root.upload
    assert (u.url, u.endpoint, u.region, u.access_key_id) == ("", "", "", "")
    assert u.secret_access_key.get_secret_value() == ""
    assert (u.concurrency, u.part_size, u.max_bandwidth) == (4, 64 * MiB, None)
    assert (u.connect_timeout, u.read_timeout, u.request_timeout, u.attempts) == (10, 60, 600, 5)
    assert u.enabled is False
    local = root.retention.local
    assert (local.keep_last, local.keep_best, local.keep_every) == (2, 1, 0)
    assert local.keep_within is None
    assert local.compress_older is False
    assert local.min_free == FreeSpace(percent=10.0)
    assert local.delete_invalid is False
    remote = root.retention.remote
    assert (remote.keep_last, remote.keep_best, remote.keep_every) == (10, 3, 5000)
    assert remote.keep_within == 30 * 86400.0


def test_root_options_slice(tmp_path: Path) -> None:
    root = load(tmp_path, MINIMAL_ROOT + 'settle = "2s"\nworld_size = 8\n').root("llm")
    assert (root.options.settle, root.options.world_size) == (2.0, 8)


def test_unknown_root_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="llm"):
        load(tmp_path, MINIMAL_ROOT).root("nope")


# --- [defaults] merging -----------------------------------------------------------------------


def test_defaults_merge_deeply_and_roots_win(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        """
        [defaults]
        settle = "10s"
        metric = "val_loss"
        [defaults.compress]
        level = 9
        codec = "zstd"
        [defaults.retention.local]
        keep_last = 5
        keep_best = 2

        [[roots]]
        name = "a"
        path = "a"
        [roots.compress]
        level = 1
        [roots.retention.local]
        keep_best = 0

        [[roots]]
        name = "b"
        path = "b"
        settle = "1s"
        """,
    )
    a, b = config.root("a"), config.root("b")
    assert (a.settle, a.metric) == (10.0, "val_loss")
    assert (a.compress.level, a.compress.codec) == (1, "zstd")
    assert (a.retention.local.keep_last, a.retention.local.keep_best) == (5, 0)
    assert a.retention.remote.keep_last == 10
    assert (b.settle, b.compress.level, b.retention.local.keep_best) == (1.0, 9, 2)


def test_defaults_cannot_name_a_root(tmp_path: Path) -> None:
    text = problems(tmp_path, '[defaults]\nname = "x"\npath = "p"\n' + MINIMAL_ROOT)
    assert "defaults.name: cannot be a default" in text
    assert "defaults.path: cannot be a default" in text


def test_bad_default_reported_once_under_defaults(tmp_path: Path) -> None:
    text = problems(
        tmp_path,
        "[defaults.compress]\nlevel = 99\n" + MINIMAL_ROOT + '[[roots]]\nname = "b"\npath = "b"\n',
    )
    assert text.count("level") == 1
    assert "defaults.compress.level: must be a whole number from 1 to 22, got 99" in text


def test_root_override_of_a_bad_default_still_reports_the_default(tmp_path: Path) -> None:
    text = problems(tmp_path, '[defaults]\nsettle = "soon"\n' + MINIMAL_ROOT + 'settle = "1s"\n')
    assert text.startswith(str(tmp_path / "ckptd.toml") + ": defaults.settle:")
    assert "roots[0]" not in text


# --- units and parsed types ---------------------------------------------------------------------


def test_units_are_parsed(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        """
        [daemon]
        scan_interval = "1h30m"
        [[roots]]
        name = "llm"
        path = "p"
        settle = "500ms"
        [roots.upload]
        url = "s3://bucket/prefix"
        part_size = "1.5GiB"
        max_bandwidth = "200MB/s"
        [roots.retention.local]
        keep_within = "24h"
        min_free = "50GB"
        [roots.retention.remote]
        keep_within = ""
        """,
    )
    root = config.root("llm")
    assert config.daemon.scan_interval == 5400.0
    assert root.settle == 0.5
    assert root.upload.part_size == 3 * 1024**3 // 2
    assert root.upload.max_bandwidth == 200_000_000
    assert root.retention.local.keep_within == 86400.0
    assert root.retention.local.min_free == FreeSpace(bytes=50 * 1000**3)
    assert root.retention.local.min_free.required(10**15) == 50 * 1000**3
    assert root.retention.remote.keep_within is None


def test_settle_zero_is_allowed(tmp_path: Path) -> None:
    assert load(tmp_path, MINIMAL_ROOT + "settle = 0\n").root("llm").settle == 0.0


@pytest.mark.parametrize("layout", ["auto", *layouts.names()])
def test_every_layout_name_is_accepted(tmp_path: Path, layout: str) -> None:
    assert load(tmp_path, MINIMAL_ROOT + f'layout = "{layout}"\n').root("llm").layout == layout


def test_metrics_listen_address(tmp_path: Path) -> None:
    config = load(tmp_path, '[metrics]\nlisten = "127.0.0.1:9464"\n')
    assert config.metrics.address == ("127.0.0.1", 9464)
    config = load(tmp_path, '[metrics]\nlisten = "[::1]:9464"\n')
    assert config.metrics.address == ("::1", 9464)


# --- bad values name their key path -------------------------------------------------------------


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[daemon]\nworkers = 0", "daemon.workers: must be a whole number from 1 to 64, got 0"),
        ('[daemon]\nworkers = "2"', 'daemon.workers: must be a whole number from 1 to 64, got "2"'),
        ("[daemon]\npolling = 1", "daemon.polling: must be true or false, got 1"),
        ('[daemon]\nscan_interval = "0s"', "daemon.scan_interval: must be a duration above zero"),
        ('[daemon]\nscan_interval = "30"', 'daemon.scan_interval: "30" has no unit'),
        ('[daemon]\nlog_format = "xml"', "daemon.log_format: must be one of: auto, json, console"),
        ('[daemon]\nlog_level = "INFO"', "daemon.log_level: must be one of: debug, info"),
        ("[daemon]\nstate_dir = 5", "daemon.state_dir: must be a path"),
        ('[daemon]\nsocket = "' + "s" * 120 + '"', "daemon.socket: "),
        ('[metrics]\nlisten = "9464"', 'metrics.listen: "9464" is not an address'),
        ('[metrics]\nlisten = "h:0"', 'metrics.listen: "h:0" is not an address'),
        ("daemon = 3", "daemon: must be a table, got 3"),
    ],
)
def test_bad_daemon_values_name_their_key(tmp_path: Path, toml: str, expected: str) -> None:
    assert expected in problems(tmp_path, toml + "\n")


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ('name = "bad name"', 'roots[0].name: "bad name" is not a usable root name'),
        ('name = ".hidden"', "roots[0].name:"),
        ('name = "' + "n" * 65 + '"', "roots[0].name:"),
        ('layout = "zip"', "roots[0].layout: must be one of: auto, native, registered"),
        ('settle = "soon"', 'roots[0].settle: "soon" is not a duration'),
        ("settle = 5", "roots[0].settle: 5 has no unit"),
        ("world_size = -1", "roots[0].world_size: must be a whole number from 0 to 10^9, got -1"),
        ('deep_validate = "yes"', 'roots[0].deep_validate: must be true or false, got "yes"'),
        ('metric_mode = "lowest"', "roots[0].metric_mode: must be one of: min, max"),
        ("metric = 1.5", "roots[0].metric: must be a string, got 1.5"),
        ("compress = 1", "roots[0].compress: must be a table, got 1"),
        ('[roots.compress]\ncodec = "gzip"', "roots[0].compress.codec: must be one of: auto, zstd"),
        ("[roots.compress]\nlevel = 0", "roots[0].compress.level: must be a whole number from 1"),
        ("[roots.compress]\nthreads = 0",
         "roots[0].compress.threads: must be a whole number from 1 to 64"),
        ("[roots.compress]\nmin_saving = 1.0", "roots[0].compress.min_saving: must be a number"),
        ("[roots.compress]\nmin_saving = -0.1", "roots[0].compress.min_saving:"),
        (
            '[roots.upload]\nurl = "ftp://h/x"',
            'roots[0].upload.url: "ftp://h/x" is not a supported',
        ),
        ('[roots.upload]\nurl = "s3://"', 'roots[0].upload.url: "s3://" names no bucket'),
        ('[roots.upload]\nurl = "/srv/ckpt"', "roots[0].upload.url:"),
        ('[roots.upload]\nurl = "file://host/x"', 'roots[0].upload.url: "file://host/x" names a'),
        ('[roots.upload]\nendpoint = "minio:9000"', "roots[0].upload.endpoint:"),
        ("[roots.upload]\nconcurrency = 0", "roots[0].upload.concurrency: must be a whole number"),
        ('[roots.upload]\npart_size = "big"', 'roots[0].upload.part_size: "big" is not a size'),
        ('[roots.upload]\npart_size = "0"', "roots[0].upload.part_size: must be a size above zero"),
        ('[roots.upload]\nmax_bandwidth = "200MB"', "roots[0].upload.max_bandwidth:"),
        ('[roots.upload]\nread_timeout = "0s"', "roots[0].upload.read_timeout: must be a duration"),
        ('[roots.upload]\nrequest_timeout = "400d"', "roots[0].upload.request_timeout: must be"),
        ("[roots.upload]\nattempts = 0", "roots[0].upload.attempts: must be a whole number"),
        (
            '[roots.retention.local]\nkeep_last = "two"',
            'roots[0].retention.local.keep_last: must be a whole number from 0 to 10^9, got "two"',
        ),
        ("[roots.retention.local]\nkeep_best = 1.0", "roots[0].retention.local.keep_best:"),
        ('[roots.retention.local]\nkeep_within = "1y"', "roots[0].retention.local.keep_within:"),
        ('[roots.retention.local]\nmin_free = "100%"', "roots[0].retention.local.min_free:"),
        ("[roots.retention.local]\ndelete_invalid = 0", "roots[0].retention.local.delete_invalid"),
        ("[roots.retention.remote]\nkeep_every = -5", "roots[0].retention.remote.keep_every:"),
    ],
)
def test_bad_root_values_name_their_key(tmp_path: Path, lines: str, expected: str) -> None:
    if lines.startswith("name ="):
        text = problems(tmp_path, MINIMAL_ROOT.replace('name = "llm"', lines))
    else:
        text = problems(tmp_path, MINIMAL_ROOT + lines + "\n")
    assert expected in text
    assert "Input should" not in text


def test_secret_is_never_echoed_in_errors(tmp_path: Path) -> None:
    text = problems(tmp_path, MINIMAL_ROOT + "[roots.upload]\nsecret_access_key = 123456789\n")
    assert "roots[0].upload.secret_access_key: must be a string" in text
    assert "123456789" not in text


def test_every_problem_is_collected(tmp_path: Path) -> None:
    text = problems(
        tmp_path,
        """
        [daemon]
        workers = 0
        [[roots]]
        name = "a"
        path = "a"
        [roots.retention.local]
        keep_last = "two"
        [[roots]]
        path = "b"
        [roots.retention.local]
        keep_last = "three"
        """,
    )
    assert "4 problems" in text
    assert "daemon.workers:" in text
    assert ('roots[0].retention.local.keep_last: must be a whole number from 0 to 10^9,'
            ' got "two"') in text
    assert "roots[1].name: is required" in text
    assert ('roots[1].retention.local.keep_last: must be a whole number from 0 to 10^9,'
            ' got "three"') in text


def test_root_without_path_is_reported(tmp_path: Path) -> None:
    assert "roots[0].path: is required" in problems(tmp_path, '[[roots]]\nname = "a"\n')


def test_roots_must_be_tables(tmp_path: Path) -> None:
    assert "roots: must be a list" in problems(tmp_path, 'roots = "a"\n')
    assert "roots[0]: must be a table" in problems(tmp_path, "roots = [1]\n")


# --- unknown keys -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("colour = 1", "colour: unknown key"),
        ("[daemon]\nwrkers = 1", 'daemon.wrkers: unknown key (did you mean "workers"?)'),
        ("[metrics]\nport = 1", "metrics.port: unknown key"),
        ("[defaults]\nsettel = 1", 'defaults.settel: unknown key (did you mean "settle"?)'),
        ("[defaults.compress]\nlvl = 1", "defaults.compress.lvl: unknown key"),
        ("[defaults.retention.local]\nx = 1", "defaults.retention.local.x: unknown key"),
        (MINIMAL_ROOT + "colour = 1", "roots[0].colour: unknown key"),
        (MINIMAL_ROOT + "[roots.compress]\ncolour = 1", "roots[0].compress.colour: unknown key"),
        (MINIMAL_ROOT + "[roots.upload]\nbucket = 1", "roots[0].upload.bucket: unknown key"),
        (MINIMAL_ROOT + "[roots.retention]\nx = 1", "roots[0].retention.x: unknown key"),
        (MINIMAL_ROOT + "[roots.retention.remote]\nkeep = 1", "roots[0].retention.remote.keep:"),
        (MINIMAL_ROOT + '"odd key" = 1', 'roots[0]."odd key": unknown key'),
    ],
)
def test_unknown_keys_at_every_level(tmp_path: Path, toml: str, expected: str) -> None:
    assert expected in problems(tmp_path, toml + "\n")


# --- roots against each other -------------------------------------------------------------------


def two_roots(a: str, b: str, name_b: str = "b") -> str:
    return f'[[roots]]\nname = "a"\npath = "{a}"\n[[roots]]\nname = "{name_b}"\npath = "{b}"\n'


def test_duplicate_root_names(tmp_path: Path) -> None:
    text = problems(tmp_path, two_roots("x", "y", name_b="a"))
    assert 'roots[1].name: "a" is already the name of roots[0]' in text


def test_cross_root_problems_are_reported_with_other_problems(tmp_path: Path) -> None:
    text = problems(
        tmp_path,
        two_roots("x", "y", name_b="bad name") + two_roots("z", "x/y") + "[daemon]\nworkers = 0\n",
    )
    assert "roots[1].name:" in text and "daemon.workers:" in text
    assert 'roots[2].name: "a" is already the name of roots[0]' in text
    assert "roots[3].path:" in text and "overlaps roots[0].path" in text


@pytest.mark.parametrize(("a", "b"), [("x", "x/y"), ("x/y", "x"), ("x", "x/"), ("x", "z/../x")])
def test_overlapping_roots(tmp_path: Path, a: str, b: str) -> None:
    assert "roots[1].path:" in problems(tmp_path, two_roots(a, b))


def test_overlap_through_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert "roots[1].path:" in problems(tmp_path, two_roots("real", "link/sub"))


def test_sibling_roots_with_a_common_prefix_are_fine(tmp_path: Path) -> None:
    config = load(tmp_path, two_roots("ckpt/run", "ckpt/run2"))
    assert [r.name for r in config.roots] == ["a", "b"]


def test_state_dir_inside_a_root(tmp_path: Path) -> None:
    text = problems(tmp_path, '[daemon]\nstate_dir = "ckpt/llm/state"\n' + MINIMAL_ROOT)
    assert "daemon.state_dir:" in text


def test_file_remote_inside_its_root(tmp_path: Path) -> None:
    text = problems(tmp_path, MINIMAL_ROOT + '[roots.upload]\nurl = "file:ckpt/llm/remote"\n')
    assert "roots[0].upload.url:" in text


# --- paths and URLs -----------------------------------------------------------------------------


def test_relative_paths_resolve_against_the_config_dir(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        """
        [daemon]
        state_dir = "state"
        socket = "./run/../ckptd.sock"
        [[roots]]
        name = "llm"
        path = "ckpt/llm"
        [roots.upload]
        url = "file:remote/dir"
        """,
    )
    root = config.root("llm")
    assert config.daemon.state_dir == tmp_path / "state"
    assert config.daemon.socket == tmp_path / "ckptd.sock"
    assert root.path == tmp_path / "ckpt" / "llm"
    assert root.upload.url == f"file://{tmp_path}/remote/dir"
    assert root.upload.file_path == tmp_path / "remote" / "dir"
    assert root.upload.enabled is True


def test_relative_paths_do_not_depend_on_the_working_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, MINIMAL_ROOT)
    monkeypatch.chdir("/")
    assert load_config(Path(path)).root("llm").path == tmp_path / "ckpt" / "llm"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("file:///srv/ckpt", "file:///srv/ckpt"),
        ("file:///srv/ckpt/", "file:///srv/ckpt"),
        ("file:/srv/ckpt", "file:///srv/ckpt"),
        ("file://localhost/srv/ckpt", "file:///srv/ckpt"),
        ("s3://bucket", "s3://bucket"),
        ("s3://bucket/prefix/", "s3://bucket/prefix"),
        ("gs://bucket/a/b", "gs://bucket/a/b"),
        ("az://container/p", "az://container/p"),
    ],
)
def test_upload_urls(tmp_path: Path, url: str, expected: str) -> None:
    root = load(tmp_path, MINIMAL_ROOT + f'[roots.upload]\nurl = "{url}"\n').root("llm")
    assert root.upload.url == expected


def test_parse_config_uses_base_dir(tmp_path: Path) -> None:
    config = parse_config({"roots": [{"name": "r", "path": "p"}]}, tmp_path)
    assert config.root("r").path == tmp_path / "p"


# --- files, syntax, output ----------------------------------------------------------------------


def test_toml_syntax_error_names_file_line_and_column(tmp_path: Path) -> None:
    text = problems(tmp_path, "[daemon]\nworkers = 2\nstate_dir /x\n")
    assert str(tmp_path / "ckptd.toml") in text
    assert "line 3" in text and "column" in text


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.toml")


def test_redacted_hides_secrets_and_renders_units(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        MINIMAL_ROOT
        + """
        settle = "90s"
        [roots.upload]
        url = "s3://bucket/p"
        endpoint = "https://user:hunter2@minio.local:9000"
        access_key_id = "AKIAEXAMPLE"
        secret_access_key = "very-secret"
        max_bandwidth = "200MB/s"
        [roots.retention.local]
        keep_within = "24h"
        """,
    )
    data = config.redacted()
    upload = data["roots"][0]["upload"]
    assert upload["secret_access_key"] == "***"
    assert upload["access_key_id"] == "AKIAEXAMPLE"
    assert upload["endpoint"] == "https://user:***@minio.local:9000"
    assert upload["part_size"] == "64MiB"
    assert upload["max_bandwidth"] == "200MB/s"
    assert data["roots"][0]["settle"] == "1m30s"
    assert data["roots"][0]["retention"]["local"]["keep_within"] == "1d"
    assert data["roots"][0]["retention"]["local"]["min_free"] == "10%"
    assert data["daemon"]["scan_interval"] == "30s"
    text = render_toml(data)
    assert "very-secret" not in text and "hunter2" not in text


def test_rendered_config_loads_back_to_the_same_config(tmp_path: Path) -> None:
    config = load_config(REPO / "config.example.toml")
    text = render_toml(config.redacted())
    assert parse_config(tomllib.loads(text), Path("/elsewhere")) == config


def test_render_toml_quotes_and_escapes() -> None:
    text = render_toml({"a b": 'x"y\n', "t": {"n": 1.5, "l": [1, True]}, "r": [{"k": 1}]})
    assert tomllib.loads(text) == {"a b": 'x"y\n', "t": {"n": 1.5, "l": [1, True]}, "r": [{"k": 1}]}


def test_config_is_frozen(tmp_path: Path) -> None:
    root = load(tmp_path, MINIMAL_ROOT).root("llm")
    with pytest.raises(ValueError):
        root.name = "other"


# --- the example ------------------------------------------------------------------------------


def test_example_config_loads_and_runs_from_the_repo_root() -> None:
    config = load_config(REPO / "config.example.toml")
    assert config.daemon.state_dir == REPO / ".demo" / "state"
    assert config.daemon.socket == REPO / ".demo" / "ckptd.sock"
    assert config.daemon.scan_interval <= 5
    # `ckptd demo` saves native checkpoints into the first root and single files into the second.
    assert len(config.roots) == 2
    for root in config.roots:
        assert REPO / ".demo" in root.path.parents
        assert root.upload.url == f"file://{REPO}/.demo/remote"
        assert root.settle <= 2
    demo = config.root("demo")
    assert (demo.layout, demo.metric) == ("auto", "val_loss")


def test_example_config_documents_every_key() -> None:
    text = (REPO / "config.example.toml").read_text()
    data = tomllib.loads(text)
    keys = set(_leaf_keys(RootConfig.model_fields, ""))
    written = set(_leaf_keys_of(data["defaults"])) | set(_leaf_keys_of(data["roots"][0]))
    assert keys <= written, f"undocumented per-root keys: {sorted(keys - written)}"
    assert set(DaemonConfig.model_fields) <= set(data["daemon"])
    assert set(MetricsConfig.model_fields) <= set(data["metrics"])


def _leaf_keys(fields: Mapping[str, Any], prefix: str) -> list[str]:
    out = []
    for name, field in fields.items():
        inner = getattr(field, "annotation", None)
        sub = getattr(inner, "model_fields", None)
        out += _leaf_keys(sub, f"{prefix}{name}.") if sub else [prefix + name]
    return out


def _leaf_keys_of(table: dict[str, object], prefix: str = "") -> list[str]:
    out = []
    for key, value in table.items():
        if isinstance(value, dict):
            out += _leaf_keys_of(value, f"{prefix}{key}.")
        else:
            out.append(prefix + key)
    return out


def test_a_hostname_becomes_a_node_id_the_parts_accept() -> None:
    from ckptd.cluster.commit import valid_ids
    from ckptd.config import node_of_host

    assert node_of_host("gpu-017") == "gpu-017"
    long = "worker-" + "x" * 200 + ".cluster.example.com"
    for host in (long, "_odd host!", "....", "ä-node", "a" * 64):
        node = node_of_host(host)
        assert valid_ids(node, "1-ab"), node
    assert node_of_host(long) != node_of_host(long[:-1] + "n")  # the hash keeps them apart
    assert len(node_of_host(long)) == 64 and node_of_host("a" * 64) == "a" * 64


def test_what_a_reload_cannot_apply(tmp_path: Path) -> None:
    from ckptd.config import needs_restart, parse_config

    base = {"daemon": {"state_dir": str(tmp_path / "s")}, "roots": [{"name": "r", "path": "r"}]}
    old = parse_config(base, tmp_path)
    assert needs_restart(old, old) == []
    moved = parse_config({**base, "daemon": {"state_dir": str(tmp_path / "t"),
                                             "socket": str(tmp_path / "x.sock")},
                          "metrics": {"listen": "127.0.0.1:9101"}}, tmp_path)
    assert needs_restart(old, moved) == ["daemon.state_dir", "daemon.socket", "metrics.listen"]
    tuned = parse_config({**base, "daemon": {**base["daemon"], "workers": 4, "polling": True,
                                             "log_level": "debug", "node": "n-2"}}, tmp_path)
    assert needs_restart(old, tuned) == ["daemon.workers", "daemon.polling",
                                         "daemon.log_level", "daemon.node"]
