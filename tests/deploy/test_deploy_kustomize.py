"""The DaemonSet as a kustomize base, without host networking: its node id from the downward
API into CKPTD_NODE, a CPU request and no CPU limit, and a kustomization.yaml naming every
manifest of the base and nothing else (rendered by `kubectl kustomize` where it is installed)."""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from typing import Any

import pytest
import yaml
from test_deploy_kubernetes import DEPLOY, by_kind, ckptd_container, config_of, pod_spec

from ckptd.config import parse_config

# The base: what every cluster applies. The Secret is an example to fill in (or replace by
# workload identity), and sidecar/ a separate example.
BASE = ["namespace.yaml", "serviceaccount.yaml", "configmap.yaml", "daemonset.yaml"]


def kustomization() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    return doc


def test_the_kustomization_names_every_manifest_of_the_base_and_nothing_else() -> None:
    doc = kustomization()
    assert doc["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert doc["kind"] == "Kustomization"
    assert doc["resources"] == BASE
    top = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert top - set(BASE) == {"secret.example.yaml"}
    assert "kustomization.yaml" in (DEPLOY / "README.md").read_text()


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_kustomize_renders_the_base() -> None:
    done = subprocess.run(["kubectl", "kustomize", str(DEPLOY)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    rendered = [d for d in yaml.safe_load_all(done.stdout) if d]
    want = [d for name in BASE for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in rendered) == sorted(
        (d["kind"], d["metadata"]["name"]) for d in want)


def test_the_daemonset_needs_no_host_network_for_its_node_id() -> None:
    ds = by_kind("DaemonSet")[0]
    spec = pod_spec(ds)
    assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert "dnsPolicy" not in spec
    env = {e["name"]: e for e in ckptd_container(ds)["env"]}
    assert env["CKPTD_NODE"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    # The ConfigMap's node = "" gives way to the variable: the daemon's id is the node's name.
    cfg = parse_config(tomllib.loads(config_of(ds)[1]), DEPLOY,
                       env={"CKPTD_NODE": "ip-10-0-1-23.ec2.internal"})
    assert cfg.daemon.node_id == "ip-10-0-1-23.ec2.internal"


def test_the_daemonset_requests_cpu_without_a_cpu_limit() -> None:
    resources = ckptd_container(by_kind("DaemonSet")[0])["resources"]
    assert resources["requests"]["cpu"] and resources["requests"]["memory"]
    assert "cpu" not in resources.get("limits", {})
    assert resources["limits"]["memory"]  # memory stays bounded

