"""[daemon] keys from the environment: CKPTD_<KEY> overrides the file's value (as a pod's env
overrides a shared ConfigMap); a bad value is refused naming the variable. Real config files
through `load_config`, and a real daemon process given its node id by CKPTD_NODE."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.config import write_layout
from support.proc import DaemonHandle
from support.wait import wait_until

from ckptd.client import Client
from ckptd.config import DaemonConfig, load_config
from ckptd.config.env import variable
from ckptd.errors import ConfigError


def _config(tmp_path: Path, daemon: str = "") -> Path:
    path = tmp_path / "ckptd.toml"
    path.write_text(f"[daemon]\n{daemon}\n")
    return path


def test_every_daemon_key_has_its_variable() -> None:
    names = {variable(k) for k in DaemonConfig.model_fields}
    assert {"CKPTD_NODE", "CKPTD_STATE_DIR", "CKPTD_SOCKET", "CKPTD_SCAN_INTERVAL",
            "CKPTD_WORKERS", "CKPTD_POLLING", "CKPTD_LEASE_TIMEOUT"} <= names
    assert len(names) == len(DaemonConfig.model_fields)


def test_the_environment_overrides_the_file(tmp_path: Path) -> None:
    path = _config(tmp_path, 'node = "from-file"\nworkers = 3\nscan_interval = "1m"')
    env = {"CKPTD_NODE": "gpu-node-7", "CKPTD_WORKERS": "4", "CKPTD_POLLING": "true",
           "CKPTD_SCAN_INTERVAL": "15s", "CKPTD_STATE_DIR": str(tmp_path / "state"),
           "CKPTD_UNRELATED": "ignored"}
    d = load_config(path, env=env).daemon
    assert (d.node, d.workers, d.polling, d.scan_interval) == ("gpu-node-7", 4, True, 15.0)
    assert d.state_dir == tmp_path / "state"
    assert load_config(path, env={}).daemon.node == "from-file"


def test_a_numeric_node_name_stays_a_node_name(tmp_path: Path) -> None:
    assert load_config(_config(tmp_path), env={"CKPTD_NODE": "1234"}).daemon.node == "1234"


@pytest.mark.parametrize(("env", "named"), [
    ({"CKPTD_WORKERS": "many"}, "CKPTD_WORKERS (daemon.workers)"),
    ({"CKPTD_NODE": "bad node!"}, "CKPTD_NODE (daemon.node)"),
    ({"CKPTD_SCAN_INTERVAL": "0s"}, "CKPTD_SCAN_INTERVAL (daemon.scan_interval)"),
    ({"CKPTD_POLLING": "yes"}, "CKPTD_POLLING (daemon.polling)"),
])
def test_a_bad_value_names_its_variable(tmp_path: Path, env: dict[str, str],
                                        named: str) -> None:
    with pytest.raises(ConfigError, match=rf"{named.replace('(', '[(]').replace(')', '[)]')}:"):
        load_config(_config(tmp_path), env=env)


def test_the_file_names_its_own_keys_when_no_variable_is_set(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"ckptd.toml: daemon.workers:"):
        load_config(_config(tmp_path, 'workers = "x"'), env={})


def test_a_daemon_takes_its_node_id_from_ckptd_node(tmp_path: Path, short_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    layout = write_layout(tmp_path, short_dir / "e.sock", node="from-file")
    monkeypatch.setenv("CKPTD_NODE", "node-from-env")
    assert os.environ["CKPTD_NODE"] == "node-from-env"
    d = DaemonHandle(layout, tmp_path / "daemon.log").start()
    try:
        def holder() -> str | None:
            doc = Client(d.socket, timeout=5.0, strict=True).status()
            assert doc is not None
            lease = doc["roots"][0].get("holder") or {}
            return lease.get("node")  # type: ignore[no-any-return]
        assert wait_until(holder, 15.0, "the lease holder") == "node-from-env"
    finally:
        d.stop()
