"""The container image and the Kubernetes manifests, offline: every manifest is valid for its
kind (the API's own schemas, strict), the configs they carry pass `ckptd config check`, every
command they and the Dockerfile run is a real ckptd command, the mounts, ports and grace
periods agree with the config and the daemon, and the image's entrypoint, probes and preStop
hook, run as plain processes, start, watch and stop a real daemon. `ckptd probe` and `ckptd
flush` are tested here too, against real daemons on real sockets."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import signal
import socket
import struct
import subprocess
import sys
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml
from support.wait import wait_until

from ckptd.cli.main import main
from ckptd.cli.parser import build_parser
from ckptd.cli.probe import LIVE, READY, verdict
from ckptd.config import load_config
from ckptd.daemon import CANCEL_WAIT_S, STOP_GRACE_S
from ckptd.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "kubernetes"
# The oldest release the sidecar example runs on (native sidecars are on by default from
# 1.29) and a current one: a field either lacks, or that one of them rejects, fails here.
K8S_VERSIONS = ("1.29", "1.33")
BIN = Path(sys.executable).parent  # where `ckptd` is installed beside this Python
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
       "AWS_EC2_METADATA_DISABLED": "true"}
ENV.pop("CKPTD_SOCKET", None)
ENV.pop("CKPTD_CONFIG", None)


# -- the files ---------------------------------------------------------------------------------


def manifest_files() -> list[Path]:
    """The Kubernetes manifests (kustomization.yaml is kustomize's, checked on its own)."""
    return [p for p in sorted(DEPLOY.rglob("*.yaml")) if p.name != "kustomization.yaml"]


def manifests() -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for path in manifest_files():
        out += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in manifests() if doc["kind"] == kind]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = doc["spec"]["template"]["spec"]
    return spec


def workloads() -> list[dict[str, Any]]:
    return [doc for _, doc in manifests() if doc["kind"] in ("DaemonSet", "Job")]


def ckptd_container(doc: dict[str, Any]) -> dict[str, Any]:
    """The container that runs the daemon (a container, or a native sidecar)."""
    spec = pod_spec(doc)
    found = [c for c in spec.get("initContainers", []) + spec["containers"]
             if c.get("args", [])[:1] == ["run"]]
    assert len(found) == 1, f"{doc['metadata']['name']}: one container runs `ckptd run`"
    return found[0]


def config_of(doc: dict[str, Any]) -> tuple[str, str]:
    """(the ConfigMap's name, its ckptd.toml) that a workload's daemon reads."""
    c = ckptd_container(doc)
    config_path = PurePosixPath(c["args"][c["args"].index("--config") + 1])
    mount = next(m for m in c["volumeMounts"] if PurePosixPath(m["mountPath"]) ==
                 config_path.parent)
    volume = next(v for v in pod_spec(doc)["volumes"] if v["name"] == mount["name"])
    name = volume["configMap"]["name"]
    cm = next(m for m in by_kind("ConfigMap") if m["metadata"]["name"] == name)
    return name, cm["data"][config_path.name]


def ckptd_commands() -> list[tuple[str, list[str]]]:
    """Every ckptd command line the manifests and the Dockerfile run: (where, argv after
    `ckptd`). A container's args go to the image's entrypoint, which runs ckptd."""
    out = []
    for doc in workloads():
        name = doc["metadata"]["name"]
        spec = pod_spec(doc)
        for c in spec.get("initContainers", []) + spec["containers"]:
            if image_name(c["image"]) != "ckptd":
                continue
            where = f"{name}/{c['name']}"
            if "command" not in c:
                out.append((f"{where} args", list(c["args"])))
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                if probe in c:
                    out.append((f"{where} {probe}", ckptd_argv(c[probe]["exec"]["command"])))
            if "lifecycle" in c:
                out.append((f"{where} preStop",
                            ckptd_argv(c["lifecycle"]["preStop"]["exec"]["command"])))
    df = dockerfile()
    out.append(("Dockerfile CMD", entrypoint_argv(df)[1:]))
    out.append(("Dockerfile HEALTHCHECK", ckptd_argv(healthcheck(df))))
    return out


def ckptd_argv(command: list[str]) -> list[str]:
    assert command[0] == "ckptd", f"{command}: not a ckptd command"
    return list(command[1:])


def image_name(image: str) -> str:
    return image.rsplit("/", 1)[-1].split(":", 1)[0]


def dockerfile() -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (KEYWORD, arguments), continuation lines joined and
    comments dropped (as Docker reads it)."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in (REPO / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).partition(" ")
        out.append((keyword.upper(), rest.strip()))
        pending = ""
    return out


def instructions(df: list[tuple[str, str]], keyword: str) -> list[str]:
    return [rest for k, rest in df if k == keyword]


def runtime_stage(df: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (k, _) in enumerate(df) if k == "FROM")
    return df[last_from:]


def entrypoint_argv(df: list[tuple[str, str]]) -> list[str]:
    """What the image runs by default, ENTRYPOINT then CMD (both exec form), with the
    entrypoint's `sh -c` wrapper resolved to the ckptd command it execs."""
    stage = runtime_stage(df)
    entry = json.loads(instructions(stage, "ENTRYPOINT")[-1])
    cmd = json.loads(instructions(stage, "CMD")[-1])
    assert entry[:2] == ["/bin/sh", "-c"] and entry[3] == "ckptd", entry
    assert re.fullmatch(r'umask 0007 && exec ckptd "\$@"', entry[2]), entry[2]
    return ["ckptd", *cmd]


def healthcheck(df: list[tuple[str, str]]) -> list[str]:
    rest = instructions(runtime_stage(df), "HEALTHCHECK")[-1]
    options, _, cmd = rest.partition(" CMD ")
    assert "--timeout=" in options
    return list(json.loads(cmd))


def arg_default(df: list[tuple[str, str]], name: str) -> str:
    values = [rest.split("=", 1)[1].strip('"') for rest in instructions(df, "ARG")
              if rest.split("=", 1)[0] == name]
    assert values, f"no ARG {name}"
    assert len(set(values)) == 1, f"ARG {name} has several defaults: {values}"
    return values[0]


def seconds_of(command: list[str], flag: str = "--timeout") -> float:
    return float(command[command.index(flag) + 1])


# -- the manifests against the Kubernetes API ------------------------------------------------


@pytest.mark.parametrize("path", manifest_files(),
                         ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_is_valid_for_its_kind(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs, f"{path}: no manifest"
    for doc in docs:
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path)
                pytest.fail(f"{path.name}: {doc['kind']} {doc['metadata']['name']} is not"
                            f" valid for Kubernetes {version}: {where}: {exc.message}")


def test_the_manifests_are_the_ones_the_readme_walks_through() -> None:
    kinds = sorted((p.relative_to(DEPLOY).as_posix(), d["kind"]) for p, d in manifests())
    assert kinds == [("configmap.yaml", "ConfigMap"), ("daemonset.yaml", "DaemonSet"),
                     ("namespace.yaml", "Namespace"), ("secret.example.yaml", "Secret"),
                     ("serviceaccount.yaml", "ServiceAccount"),
                     ("sidecar/configmap.yaml", "ConfigMap"), ("sidecar/job.yaml", "Job")]
    readme = (DEPLOY / "README.md").read_text()
    for name, _ in kinds:
        assert name in readme, f"README.md does not mention {name}"
    # Everything the workloads reference exists: the config, the Secret, the account.
    secret = by_kind("Secret")[0]["metadata"]["name"]
    for doc in workloads():
        config_of(doc)
        c = ckptd_container(doc)
        from_secret = [e for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})]
        refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in from_secret}
        refs |= {v["secret"]["secretName"] for v in pod_spec(doc)["volumes"] if "secret" in v}
        assert refs == {secret}
        keys = {e["valueFrom"]["secretKeyRef"]["key"] for e in from_secret}
        # AWS_SESSION_TOKEN: only with temporary keys, so the example leaves it out
        assert keys <= set(by_kind("Secret")[0]["stringData"]) | {"AWS_SESSION_TOKEN"}
    ds = by_kind("DaemonSet")[0]
    assert pod_spec(ds)["serviceAccountName"] == by_kind("ServiceAccount")[0]["metadata"]["name"]
    namespace = by_kind("Namespace")[0]["metadata"]["name"]
    for path, doc in manifests():
        if path.parent == DEPLOY and doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == namespace, path.name


def test_the_readmes_training_pod_is_valid_and_mounts_what_the_daemon_serves() -> None:
    """The training pod README.md shows beside the DaemonSet: a valid Pod that mounts the
    node's socket directory and checkpoint directory where ckptd has them, runs with the
    daemon's group as its primary group, and points CKPTD_SOCKET at the config's socket."""
    blocks = re.findall(r"```yaml\n(.*?)```", (DEPLOY / "README.md").read_text(), re.S)
    assert len(blocks) == 1
    pod = yaml.safe_load(blocks[0])
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(pod, version, strict=True)
    ds = by_kind("DaemonSet")[0]
    cfg = tomllib.loads(config_of(ds)[1])
    host = {v["name"]: v["hostPath"]["path"] for v in pod_spec(ds)["volumes"] if "hostPath" in v}
    pod_host = {v["name"]: v["hostPath"]["path"] for v in pod["spec"]["volumes"]}
    trainer = pod["spec"]["containers"][0]
    mounted = {pod_host[m["name"]]: m["mountPath"] for m in trainer["volumeMounts"]}
    socket_dir = str(PurePosixPath(cfg["daemon"]["socket"]).parent)
    roots_dir = str(PurePosixPath(cfg["roots"][0]["path"]).parent)
    assert mounted == {host["run"]: socket_dir, host["checkpoints"]: roots_dir}
    assert {e["name"]: e["value"] for e in trainer["env"]} == {
        "CKPTD_SOCKET": cfg["daemon"]["socket"]}
    assert pod["spec"]["securityContext"]["runAsGroup"] == pod_spec(ds)["securityContext"][
        "runAsGroup"]


# -- the commands they run ----------------------------------------------------------------------


def test_every_command_is_a_real_ckptd_command() -> None:
    """Each command line parses with ckptd's own parser, and `ckptd SUB --help` of each
    subcommand runs (the installed console script)."""
    commands = ckptd_commands()
    used = {}
    for where, argv in commands:
        try:
            args = build_parser().parse_args(argv)
        except (SystemExit, UsageError) as exc:  # a bad command line; --help and the like
            pytest.fail(f"{where}: `ckptd {shlex.join(argv)}`: {exc!r}")
        used[args.command] = where
    assert set(used) == {"run", "probe", "flush"}
    for sub in sorted(used):
        r = subprocess.run(["ckptd", sub, "--help"], capture_output=True, text=True, env=ENV,
                           timeout=60)
        assert r.returncode == 0 and f"usage: ckptd {sub}" in r.stdout, (sub, r.stderr)
    # The probes: start-up and readiness ask `ready`, liveness and HEALTHCHECK `live`.
    for where, argv in commands:
        if where.endswith(("startupProbe", "readinessProbe")):
            assert argv[:2] == ["probe", "ready"], where
        if where.endswith(("livenessProbe", "HEALTHCHECK")):
            assert argv[:2] == ["probe", "live"], where


def test_the_probes_and_prestop_fit_their_time_limits() -> None:
    """The pod's grace period covers the preStop flush and the daemon's own stop; a probe's
    answer comes before the kubelet gives up on it; liveness gives a hung daemon as long as
    the systemd unit's watchdog does."""
    unit = (REPO / "systemd" / "ckptd.service").read_text()
    watchdog_s = float(re.search(r"^WatchdogSec=(\d+)$", unit, re.M).group(1))  # type: ignore[union-attr]
    probe_timeout = build_parser().parse_args(["probe", "live"]).timeout
    for doc in workloads():
        c = ckptd_container(doc)
        pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
        grace = pod_spec(doc)["terminationGracePeriodSeconds"]
        assert grace >= seconds_of(pre_stop) + STOP_GRACE_S + CANCEL_WAIT_S + 10, grace
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["timeoutSeconds"] >= probe_timeout + 2, probe
        live = c["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] >= watchdog_s
    df = dockerfile()
    options = instructions(runtime_stage(df), "HEALTHCHECK")[-1]
    assert int(re.search(r"--timeout=(\d+)s", options).group(1)) >= probe_timeout + 2  # type: ignore[union-attr]


# -- the config, the mounts and the image ----------------------------------------------------


def mirror(doc: dict[str, Any], base: Path) -> dict[str, Path]:
    """Each writable mount of the daemon's container -> a directory under `base`."""
    out = {}
    for m in ckptd_container(doc)["volumeMounts"]:
        if not m.get("readOnly"):
            out[m["mountPath"]] = base / m["name"]
            out[m["mountPath"]].mkdir(parents=True, exist_ok=True)
    return out


def rewritten(text: str, mounts: dict[str, Path], remote: Path, metrics_port: int) -> str:
    """The config with each path below a mount moved to that mount's mirror, the upload to a
    file:// directory and the metrics listener to a loopback port."""
    longest_first = sorted(mounts, key=len, reverse=True)
    pattern = "|".join(re.escape(m) for m in longest_first)
    text = re.sub(rf'"({pattern})(/[^"]*)?"',
                  lambda m: f'"{mounts[m.group(1)]}{m.group(2) or ""}"', text)
    text = re.sub(r'(?m)^url = "[^"]*"', f'url = "file://{remote}"', text)
    return re.sub(r'(?m)^listen = "[^"]*"', f'listen = "127.0.0.1:{metrics_port}"', text)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("kind", ["DaemonSet", "Job"])
def test_the_config_passes_its_check_and_lives_on_the_mounts(kind: str, short_dir: Path,
                                                             tmp_path: Path) -> None:
    """Every path the config names (state, socket, roots) is on a writable mount of the
    daemon's container: moved to the mounts' mirrors, none is left behind, and the result
    passes `ckptd config check`."""
    doc = by_kind(kind)[0]
    _, text = config_of(doc)
    original = load_config(write(tmp_path / "original.toml", text))
    mounts = mirror(doc, short_dir)
    path = write(tmp_path / "ckptd.toml", rewritten(text, mounts, tmp_path / "remote", 9464))
    cfg = load_config(path)
    named = [cfg.daemon.state_dir, cfg.daemon.socket, *(r.path for r in cfg.roots)]
    for p in named:
        assert any(p.is_relative_to(d) for d in mounts.values()), f"{p}: on no writable mount"
    assert [r.name for r in cfg.roots] == [r.name for r in original.roots]
    r = subprocess.run(["ckptd", "config", "check", str(path)], capture_output=True, text=True,
                       env=ENV, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"OK ({len(cfg.roots)} root(s))" in r.stdout


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_the_trainer_and_the_nodes_see_the_daemons_paths() -> None:
    """Paths cross containers unchanged: the sidecar's trainer mounts the socket directory
    and the checkpoint root where the daemon has them, and its CKPTD_SOCKET is the config's
    socket; the DaemonSet mounts each hostPath at its own path on the node, which training
    pods mount at the same path too."""
    job = by_kind("Job")[0]
    cfg = tomllib.loads(config_of(job)[1])
    daemon_mounts = {m["name"]: m["mountPath"] for m in ckptd_container(job)["volumeMounts"]}
    trainer = next(c for c in pod_spec(job)["containers"] if c["name"] == "trainer")
    for m in trainer["volumeMounts"]:
        assert daemon_mounts[m["name"]] == m["mountPath"], m
    shared = {m["mountPath"] for m in trainer["volumeMounts"]}
    assert str(PurePosixPath(cfg["daemon"]["socket"]).parent) in shared
    for root in cfg["roots"]:
        assert any(PurePosixPath(root["path"]).is_relative_to(s) for s in shared), root
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["CKPTD_SOCKET"] == cfg["daemon"]["socket"]
    ds = by_kind("DaemonSet")[0]
    host = {v["name"]: v["hostPath"]["path"] for v in pod_spec(ds)["volumes"] if "hostPath" in v}
    for m in ckptd_container(ds)["volumeMounts"]:
        if m["name"] in host:
            assert host[m["name"]] == m["mountPath"], m


def test_the_image_and_the_pods_agree_on_user_paths_and_port() -> None:
    df = dockerfile()
    stage = runtime_stage(df)
    assert arg_default(df, "PYTHON_IMAGE") == "python:3.11-slim"
    froms = instructions(df, "FROM")
    assert len(froms) == 2 and froms[0].endswith(" AS build") and "from=build" in "".join(
        instructions(stage, "RUN"))
    uid, gid = arg_default(df, "CKPTD_UID"), arg_default(df, "CKPTD_GID")
    assert instructions(stage, "USER") == ["${CKPTD_UID}:${CKPTD_GID}"] and int(uid) > 0
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(instructions(stage, "ENV"))))
    assert entrypoint_argv(df)[1:] == ["run", "--config", env["CKPTD_CONFIG"]]
    volumes = json.loads(instructions(stage, "VOLUME")[-1])
    ds = by_kind("DaemonSet")[0]
    cfg = tomllib.loads(config_of(ds)[1])
    assert sorted(volumes) == sorted([cfg["daemon"]["state_dir"],
                                      str(PurePosixPath(cfg["daemon"]["socket"]).parent)])
    port = cfg["metrics"]["listen"].rsplit(":", 1)[1]
    assert instructions(stage, "EXPOSE") == [port]
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == port
    ports = {p["name"]: p["containerPort"] for p in ckptd_container(ds)["ports"]}
    assert ports["metrics"] == int(port)
    for doc in workloads():
        c = ckptd_container(doc)
        assert c["args"] == entrypoint_argv(df)[1:] and "command" not in c
        ctx = {**pod_spec(doc)["securityContext"], **c.get("securityContext", {})}
        assert (str(ctx["runAsUser"]), str(ctx["runAsGroup"])) == (uid, gid)
        assert ctx["runAsNonRoot"] is True and ctx["allowPrivilegeEscalation"] is False
        assert ctx["capabilities"]["drop"] == ["ALL"] and ctx["readOnlyRootFilesystem"] is True
    # The DaemonSet's init container hands the state and socket directories to that user.
    init = next(c for c in pod_spec(ds)["initContainers"] if c["name"] == "own-dirs")
    chown = re.search(r"chown (\d+):(\d+) ([^&]+)&&", init["command"][-1])
    assert chown is not None and chown.group(1, 2) == (uid, gid)
    owned = {m["mountPath"] for m in init["volumeMounts"]}
    assert owned == set(volumes) == set(chown.group(3).split())


def test_the_sidecar_job_fits_the_restricted_pod_security_level() -> None:
    """What the "restricted" level asks of every container of the sidecar example's pod: no
    host namespaces or hostPath, a non-root user, no privilege escalation, no capabilities,
    the runtime's seccomp profile."""
    spec = pod_spec(by_kind("Job")[0])
    assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert all("hostPath" not in v for v in spec["volumes"])
    pod_ctx = spec["securityContext"]
    assert pod_ctx["runAsNonRoot"] is True and pod_ctx["runAsUser"] != 0
    assert pod_ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in spec["initContainers"] + spec["containers"]:
        ctx = c["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False, c["name"]
        assert ctx["capabilities"] == {"drop": ["ALL"]}, c["name"]
        assert ctx.get("runAsUser", pod_ctx["runAsUser"]) != 0, c["name"]


def dockerignored(rel: str, patterns: list[str]) -> bool:
    """Whether .dockerignore leaves `rel` out of the build context: the last pattern that
    matches the path or one of its parent directories decides ('!' brings it back)."""
    parts = rel.split("/")
    out = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        p = pattern.lstrip("!").rstrip("/")
        if any(fnmatch.fnmatchcase("/".join(parts[:i]), p) for i in range(1, len(parts) + 1)):
            out = not keep
    return out


def test_the_build_context_holds_what_the_dockerfile_copies() -> None:
    patterns = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    df = dockerfile()
    sources = []
    for rest in instructions(df, "COPY"):
        if "--from=" in rest:
            continue
        sources += [s for s in rest.split()[:-1] if not s.startswith("--")]
    assert "ckptd" in sources and "pyproject.toml" in sources
    for src in sources:
        assert (REPO / src).exists(), f"COPY {src}: no such file"
        assert not dockerignored(src, patterns), f"COPY {src}: left out by .dockerignore"
    for left_out in (".git/HEAD", ".venv/bin/python", "tests/conftest.py",
                     "ckptd/__pycache__/x.pyc", "docs/CLI.md"):
        assert dockerignored(left_out, patterns), left_out


# -- the image's processes around a real daemon ----------------------------------------------


def safetensors(path: Path, floats: int = 16) -> Path:
    """A complete, valid safetensors file (the `single` layout), written without torch."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [floats],
                               "data_offsets": [0, 4 * floats]}}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4 * floats))
    return path


def run_cli(argv: list[str], env: dict[str, str], timeout: float = 60
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture
def entrypoint(short_dir: Path, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The image's default process (ENTRYPOINT + CMD) as a plain process, with the DaemonSet's
    config (paths moved to tmp) at the config path; stopped by PID at the end."""
    ds = by_kind("DaemonSet")[0]
    _, text = config_of(ds)
    mounts = mirror(ds, short_dir)
    port = free_port()
    config = write(tmp_path / "ckptd.toml", rewritten(text, mounts, tmp_path / "remote", port))
    for root in load_config(config).roots:  # what training pods create on the node
        root.path.mkdir(parents=True)
    argv = entrypoint_argv(dockerfile())
    fixed = argv[argv.index("--config") + 1]
    shell = json.loads(instructions(runtime_stage(dockerfile()), "ENTRYPOINT")[-1])
    cmd = [*shell, *[str(config) if a == fixed else a for a in argv[1:]]]
    env = {**ENV, "CKPTD_CONFIG": str(config), "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "daemon.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        yield {"proc": proc, "env": env, "config": load_config(config), "port": port,
               "log": log, "ds": ds}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def test_the_image_entrypoint_serves_the_probes_and_stops_after_prestop(
        entrypoint: dict[str, Any]) -> None:
    """Started as the image starts it, the daemon answers the start-up, readiness and
    liveness probes and the HEALTHCHECK, serves /metrics where the scrape annotations point,
    writes with umask 0007, returns from the preStop flush, stops on SIGTERM with 0; then
    the probes fail."""
    proc, env, ds = entrypoint["proc"], entrypoint["env"], entrypoint["ds"]
    c = ckptd_container(ds)
    startup = c["startupProbe"]["exec"]["command"]

    def started() -> bool:
        assert proc.poll() is None, entrypoint["log"].read_text()
        return run_cli(startup, env).returncode == 0

    wait_until(started, 30, "the start-up probe", interval=0.1,
               detail=lambda: entrypoint["log"].read_text()[-3000:])
    for command in (c["readinessProbe"]["exec"]["command"],
                    c["livenessProbe"]["exec"]["command"], healthcheck(dockerfile())):
        r = run_cli(command, env)
        assert r.returncode == 0, (command, r.stdout, r.stderr)
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    url = f"http://127.0.0.1:{entrypoint['port']}{annotations['prometheus.io/path']}"
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert b"ckptd_up 1.0" in resp.read()
    state_db = entrypoint["config"].daemon.state_dir / "state.db"
    assert state_db.stat().st_mode & 0o007 == 0, oct(state_db.stat().st_mode)
    pre_stop = run_cli(c["lifecycle"]["preStop"]["exec"]["command"], env)
    assert pre_stop.returncode == 0, pre_stop.stderr
    assert "nothing to flush" in pre_stop.stdout
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    for command in (startup, c["livenessProbe"]["exec"]["command"]):
        r = run_cli(command, env)
        assert r.returncode == 69, (command, r.stdout, r.stderr)


# -- ckptd probe ---------------------------------------------------------------------------------


def probe(kind: str, sock: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli(["ckptd", "probe", kind, "--socket", str(sock), *extra], ENV)


def test_a_socket_nobody_answers_is_neither_live_nor_ready(short_dir: Path) -> None:
    """Before the daemon binds its socket, and while it is bound but not answering yet (the
    first scan runs before the server does): no answer within --timeout, exit 69."""
    sock = short_dir / "s.sock"
    for kind in (LIVE, READY):
        assert probe(kind, sock).returncode == 69
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock))
    listener.listen(8)  # never accepted: the connection waits in the backlog
    try:
        for kind in (LIVE, READY):
            r = probe(kind, sock, "--timeout", "0.5")
            assert r.returncode == 69 and "timed out" in r.stderr, r.stderr
    finally:
        listener.close()


def test_a_daemon_that_lost_its_state_database_is_neither_live_nor_ready(
        daemon_factory: Any) -> None:
    d = daemon_factory()
    for kind in (LIVE, READY):
        r = probe(kind, d.socket)
        assert r.returncode == 0 and f"ckptd is {kind} (ok" in r.stdout, r.stderr
    (d.state_dir / "state.db").unlink()

    def noticed() -> subprocess.CompletedProcess[str] | None:
        r = probe(LIVE, d.socket)
        return r if r.returncode == 1 else None

    r = wait_until(noticed, 30, "probe live to fail", interval=0.2, detail=d.log_text)
    assert "not live: the daemon stopped acting on its roots" in r.stderr
    assert "was deleted" in r.stderr
    r = probe(READY, d.socket)
    assert r.returncode == 1 and "not ready" in r.stderr


def service(name: str, state: str = "running", **extra: Any) -> dict[str, Any]:
    return {"name": name, "state": state, "restarts": 0, "last_error": None,
            "last_crash": None, **extra}


def health(status: str = "ok", problem: str | None = None, **states: str) -> dict[str, Any]:
    names = ["api", "lease", "watch", "scan", "discovery", "retention", "persist",
             "worker-0", "worker-1"]
    stuck = {"stage": "upload", "root": "r1", "step": 7, "since": 0.0, "quiet_s": 900.0,
             "bound_s": 600.0}
    services = []
    for n in names:
        state = states.get(n.replace("-", "_"), "running")
        services.append(service(n, state, **({"stuck": stuck} if state == "stuck" else {})))
    return {"status": status, "version": "0.1.0", "uptime_s": 5.0, "services": services,
            "problem": problem}


LOST = "state database /var/lib/ckptd/state.db was deleted while the daemon ran"


@pytest.mark.parametrize(("doc", "live", "ready"), [
    (health(), None, None),
    # one stuck call is degraded health, set aside: live and ready
    (health("degraded", worker_1="stuck"), None, None),
    (health("degraded", retention="stuck"), None, None),
    (health("degraded", worker_0="stuck", worker_1="stuck"),
     "every stage worker is stuck: worker-0 in upload of r1 step 7", None),
    (health("degraded", scan="stuck"), "the scan loop is stuck", None),
    (health("degraded", discovery="restarting"), "not running: discovery", None),
    (health("degraded", problem=LOST, scan="stopped", worker_0="stopped"),
     "stopped acting on its roots: " + LOST, "stopped acting on its roots"),
    # stopping: it ends on its own, a restart would not help; no longer serving
    (health("stopping", api="stopped"), None, "the daemon is stopping"),
    # a daemon whose health says no more than the SPEC's first shape
    ({"status": "ok", "version": "0.1.0", "uptime_s": 1.0}, None, None),
], ids=["ok", "one-worker-stuck", "retention-stuck", "all-workers-stuck", "scan-stuck",
        "service-restarting", "state-db-lost", "stopping", "bare"])
def test_what_each_health_means_to_the_probes(doc: dict[str, Any], live: str | None,
                                              ready: str | None) -> None:
    for kind, want in ((LIVE, live), (READY, ready)):
        got = verdict(kind, doc)
        if want is None:
            assert got is None, (kind, got)
        else:
            assert got is not None and want in got, (kind, got)


@pytest.mark.parametrize("argv", [
    ["probe", "live", "--timeout", "0"], ["probe", "ready", "--timeout", "61"],
    ["probe", "ready", "--timeout", "nan"], ["probe", "alive"],
    ["flush", "--timeout", "-1"], ["flush", "--timeout", "inf"],
])
def test_bad_probe_and_flush_command_lines_exit_2(argv: list[str], short_dir: Path) -> None:
    assert main([*argv, "--socket", str(short_dir / "s.sock")]) == 2


# -- ckptd flush ---------------------------------------------------------------------------------


@pytest.fixture
def stalled_upload(inproc_daemon: Any, tmp_path: Path) -> tuple[Any, Path]:
    """A daemon whose step 1 is valid and not uploaded: its file:// remote is a plain file,
    so the first upload failed (a permanent cause: the next try is 10 minutes away)."""
    remote = tmp_path / "remote"
    remote.write_text("not a directory")
    d = inproc_daemon(roots=[{"name": "r1", "compress": {"codec": "none"},
                              "upload": {"url": f"file://{remote}"}}])
    safetensors(d.roots["r1"] / "model_step_1.safetensors")
    d.wait_for("r1", 1)
    failed = d.wait_event("stage_failed")
    assert failed[0]["stage"] == "upload" and failed[0]["retry_in_s"] >= 60, failed
    assert d.client.checkpoint("r1", 1)["remote"] != "uploaded"
    return d, remote


def flush_cli(d: Any, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli(["ckptd", "flush", "--socket", str(d.socket), *extra], ENV, timeout=120)


def test_flush_returns_once_the_flushed_step_is_uploaded(stalled_upload: tuple[Any, Path]
                                                         ) -> None:
    d, remote = stalled_upload
    remote.unlink()
    remote.mkdir()  # the remote works again; only the flush makes the retry come now
    r = flush_cli(d, "--timeout", "60", "--json")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert json.loads(r.stdout) == {"flushed": [{"root": "r1", "step": 1, "uploaded": True,
                                                 "message": "uploaded"}]}
    assert (remote / "r1" / "step-1" / "MANIFEST.json").is_file()
    assert d.client.checkpoint("r1", 1)["remote"] == "uploaded"
    r = flush_cli(d)
    assert r.returncode == 0 and r.stdout.startswith("nothing to flush"), r.stdout


def test_flush_says_which_step_was_not_uploaded_and_why(stalled_upload: tuple[Any, Path]
                                                        ) -> None:
    """The remote still fails: the daemon gives the flush up at the first failed try, and
    `ckptd flush` returns then (exit 1, the reason), not at its timeout."""
    d, _ = stalled_upload
    r = flush_cli(d, "--no-wait", "--json")  # asks, and returns at once
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"flushed": [{"root": "r1", "step": 1, "uploaded": None,
                                                 "message": "put first"}]}
    d.wait_event("flush_abandoned")
    r = flush_cli(d, "--timeout", "100")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "r1 step 1: not uploaded: no longer flushed: its upload failed" in r.stderr
    assert "Not a directory" in r.stderr
    d.wait_event("flush_abandoned", count=2)
    assert run_cli(["ckptd", "flush", "--socket", str(d.socket.parent / "none.sock")],
                   ENV).returncode == 69
