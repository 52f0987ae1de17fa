"""The Grafana dashboard (deploy/grafana/ckptd.json) and the Prometheus alerting rules
(deploy/prometheus/ckptd-rules.yaml) against what a real daemon exports: a daemon with a
step remote-verified over file://, an invalid save and a root whose remote is unreachable is
scraped on its socket, and every PromQL expression of both files (panel targets, template
queries, alert rules) is parsed into its AST (promql-parser) and may name only series and
labels that scrape shows, plus the labels Prometheus adds to each target. The files' own
shape is checked too: what Grafana needs to import the dashboard, and Prometheus' rule-file
structure."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import promql_parser as pql
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from support.ckpts import flip_byte, save_single
from support.fixtures import running_daemon
from support.wait import wait_until

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "ckptd.json"
RULES = DEPLOY / "prometheus" / "ckptd-rules.yaml"
PROMTOOL = shutil.which("promtool")

TARGET_LABELS = frozenset({"instance", "job"})  # Prometheus adds them to every scraped series
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# Grafana's own interval variables, outside string literals: a plain duration for the parser.
GRAFANA_INTERVALS = re.compile(r"\$__(rate_interval|interval|range)\b|\$\{__(rate_interval|"
                               r"interval|range)\}")
LABEL_VALUES = re.compile(r"^\s*label_values\((?P<selector>.+),\s*(?P<label>\w+)\s*\)\s*$")
TEMPLATE_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")  # legendFormat's {{root}}
RULE_LABEL = re.compile(r"\$labels\.(\w+)")  # an annotation's {{ $labels.root }}


@dataclass
class Exported:
    """Series names a query may name -> the labels their samples carry."""

    labels: dict[str, set[str]] = field(default_factory=dict)

    def add(self, name: str, labels: set[str]) -> None:
        self.labels.setdefault(name, set()).update(labels)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    """One real daemon's /metrics after real work: r1 has step 10 remote-verified (bytes,
    stage durations, time to safe) and step 20 invalid (a flipped byte); r2's remote is a
    plain file, so its upload fails (errors) and its step waits (unsafe seconds)."""
    base = tmp_path_factory.mktemp("dash")
    (base / "broken").write_text("not a directory\n")
    roots = [{"name": "r1", "upload": {"url": f"file://{base / 'remote'}"}},
             {"name": "r2", "upload": {"url": f"file://{base / 'broken'}"}}]
    with running_daemon(base, roots=roots) as d:
        c = d.client
        save_single(d.roots["r1"], 10)
        flip_byte(save_single(d.roots["r1"], 20))
        save_single(d.roots["r2"], 10)
        assert c.wait("r1", 10, until="uploaded", timeout=60)
        assert d.wait_for("r1", 20)["state"] == "invalid"
        assert d.wait_for("r2", 10)["state"] == "valid"

        def scraped() -> str | None:
            status, text = c.request("GET", "/metrics")
            assert status == 200
            return text if 'ckptd_errors_total{kind="upload"}' in text else None

        text = wait_until(scraped, 30, "r2's failed upload counted")
    out = Exported()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.add(s.name, set(s.labels))
        if not fam.samples:  # no series now (no stuck call): the name is still the daemon's
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"],
                        "info": ["_info"]}.get(fam.type, [""])
            for suffix in suffixes:
                out.add(fam.name + suffix, set())
    return out


# -- PromQL: series and labels ------------------------------------------------------------------


class Unknown(AssertionError):
    pass


def promql(expr: str) -> Any:
    """The AST of a query as Prometheus receives it (Grafana's interval variables filled in)."""
    text = GRAFANA_INTERVALS.sub("5m", expr)
    try:
        return pql.parse(text)
    except ValueError as exc:
        raise AssertionError(f"not valid PromQL: {expr!r}: {exc}") from None


def labels_of(node: Any, ex: Exported, used: set[str]) -> set[str]:
    """The labels the expression's result may carry; raises Unknown for a series or a label
    the daemon does not export (matchers, by/without, on/ignoring/group_*). Adds each series
    name to `used`."""
    if isinstance(node, pql.VectorSelector):
        return _selector(node, ex, used)
    if isinstance(node, pql.MatrixSelector):
        return _selector(node.vector_selector, ex, used)
    if isinstance(node, pql.ParenExpr | pql.UnaryExpr | pql.SubqueryExpr):
        return labels_of(node.expr, ex, used)
    if isinstance(node, pql.NumberLiteral | pql.StringLiteral):
        return set()
    if isinstance(node, pql.Call):
        if node.func.name in ("label_replace", "label_join"):
            raise Unknown(f"{node.func.name} makes labels this check cannot follow")
        out: set[str] = set()
        for arg in node.args:
            out |= labels_of(arg, ex, used)
        return out
    if isinstance(node, pql.AggregateExpr):
        return _aggregate(node, ex, used)
    if isinstance(node, pql.BinaryExpr):
        return _binary(node, ex, used)
    raise Unknown(f"a PromQL node this check does not know: {type(node).__name__}")


def _selector(vs: Any, ex: Exported, used: set[str]) -> set[str]:
    name = vs.name or next((m.value for m in vs.matchers.matchers
                            if m.name == "__name__" and m.op == pql.MatchOp.Equal), None)
    if name == "up":  # Prometheus' own series for each target
        have = set(TARGET_LABELS)
    elif name not in ex.labels:
        raise Unknown(f"no series {name!r} in the daemon's /metrics")
    else:
        have = ex.labels[name] | TARGET_LABELS
    used.add(name)
    for m in [*vs.matchers.matchers, *(m for ms in vs.matchers.or_matchers for m in ms)]:
        if m.name != "__name__" and m.name not in have:
            raise Unknown(f"{name} has no label {m.name!r} (it has {sorted(have)})")
    return have


def _aggregate(node: Any, ex: Exported, used: set[str]) -> set[str]:
    inner = labels_of(node.expr, ex, used)
    if node.param is not None:
        labels_of(node.param, ex, used)
    mod = node.modifier
    if mod is None:
        return set()
    by = mod.type == pql.AggModifierType.By
    missing = set(mod.labels) - inner
    if missing:
        raise Unknown(f"{'by' if by else 'without'} {sorted(missing)}: not labels of"
                      f" {node.expr} (it has {sorted(inner)})")
    return set(mod.labels) if by else inner - set(mod.labels)


def _binary(node: Any, ex: Exported, used: set[str]) -> set[str]:
    left, right = labels_of(node.lhs, ex, used), labels_of(node.rhs, ex, used)
    mod = node.modifier
    if mod is not None and mod.matching is not None:
        on = mod.matching.type == pql.LabelModifierType.Include
        missing = set(mod.matching.labels) - (left & right if on else left | right)
        if missing:
            raise Unknown(f"{'on' if on else 'ignoring'} {sorted(missing)}: not labels of both"
                          f" sides of {node}")
    if mod is not None and mod.group_labels:
        missing = set(mod.group_labels) - (left | right)
        if missing:
            raise Unknown(f"group_* {sorted(missing)}: not labels of {node}")
    return left | right


def check_expr(expr: str, ex: Exported, used: set[str], shown: set[str] = frozenset()
               ) -> set[str]:
    """Check one query; `shown`: labels a legend or an annotation prints from its result."""
    out = labels_of(promql(expr), ex, used)
    missing = set(shown) - out
    assert not missing, f"{expr!r} gives no label {sorted(missing)} (only {sorted(out)})"
    return out


# -- the dashboard -----------------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def all_panels(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in doc["panels"]:
        yield p
        yield from p.get("panels", [])  # a collapsed row holds its panels


def variable_query(var: dict[str, Any]) -> str:
    q = var.get("query")
    return str(q.get("query", "") if isinstance(q, dict) else q or "")


def test_every_dashboard_query_names_only_what_the_daemon_exports(exported: Exported) -> None:
    doc = dashboard()
    used: set[str] = set()
    problems = []
    for panel in all_panels(doc):
        for t in panel.get("targets", []):
            shown = set(TEMPLATE_LABEL.findall(t.get("legendFormat", "")))
            try:
                check_expr(t["expr"], exported, used, shown)
            except AssertionError as exc:
                problems.append(f"panel {panel['title']!r} {t['refId']}: {exc}")
    for var in doc["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = LABEL_VALUES.match(variable_query(var))
        assert m, f"variable {var['name']}: not label_values(selector, label): {var['query']}"
        try:
            check_expr(m["selector"], exported, used, {m["label"]})
        except AssertionError as exc:
            problems.append(f"variable {var['name']}: {exc}")
    assert not problems, "\n".join(problems)
    # What an operator opens the dashboard for, each on a panel.
    assert {"ckptd_latest_step", "ckptd_latest_uploaded_step",
            "ckptd_latest_remote_verified_step", "ckptd_steps_since_remote_verified",
            "ckptd_unsafe_seconds", "ckptd_time_to_safe_seconds_bucket",
            "ckptd_bytes_read_total", "ckptd_bytes_written_total", "ckptd_bytes_uploaded_total",
            "ckptd_stage_duration_seconds_bucket", "ckptd_queue_depth",
            "ckptd_compression_saved_bytes", "ckptd_errors_total", "ckptd_invalid_checkpoints",
            "ckptd_disk_free_bytes", "ckptd_min_free_bytes", "up", "ckptd_degraded",
            "ckptd_config_last_reload_successful", "ckptd_root_held",
            "process_resident_memory_bytes"} <= used


def test_the_dashboard_imports_into_grafana() -> None:
    doc = dashboard()
    assert 36 <= doc["schemaVersion"] <= 41 and doc["title"] and doc["uid"]
    assert [i["name"] for i in doc["__inputs"]] == ["DS_PROMETHEUS"]
    assert doc["__inputs"][0]["pluginId"] == "prometheus"
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    for name in ("root", "instance"):
        assert variables[name]["type"] == "query" and variables[name]["datasource"] == DS
    panels = list(all_panels(doc))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids), ids
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        assert p.get("type") and p.get("title"), p
        g = p["gridPos"]
        assert all(isinstance(g[k], int) and g[k] >= 0 for k in "hwxy"), p["title"]
        assert g["w"] >= 1 and g["h"] >= 1 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):  # no two panels share a cell
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == DS, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t.get("datasource", DS) == DS and t["expr"].strip(), p["title"]
    assert "${DS_PROMETHEUS}" not in json.dumps(
        [v for v in doc["templating"]["list"] if v["name"] == "DS_PROMETHEUS"])


# -- the alerting rules ------------------------------------------------------------------------


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    assert isinstance(doc, dict) and set(doc) == {"groups"}, "a rule file is {groups: [...]}"
    out = []
    names = set()
    for group in doc["groups"]:
        assert set(group) <= {"name", "interval", "rules", "limit"} and group["name"]
        assert group["name"] not in names, f"group {group['name']} twice"
        names.add(group["name"])
        out.extend(group["rules"])
    return out


def test_the_rules_file_is_a_prometheus_rule_file() -> None:
    alerts = rules()
    assert len({r["alert"] for r in alerts}) == len(alerts)
    for r in alerts:
        assert set(r) <= {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}, r
        assert set(r) >= {"alert", "expr", "for", "labels", "annotations"}, r
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", r["alert"]), r["alert"]
        assert pql.parse_duration(r["for"]).total_seconds() > 0, r["alert"]
        assert r["labels"]["severity"] in {"critical", "warning", "info"}, r["alert"]
        assert r["annotations"]["summary"].strip(), r["alert"]
        assert r["annotations"]["description"].strip(), r["alert"]
        promql(r["expr"])
    with pytest.raises(ValueError):
        pql.parse_duration("ten minutes")  # the duration check does refuse


def test_every_rule_names_only_what_the_daemon_exports(exported: Exported) -> None:
    used: set[str] = set()
    problems = []
    for r in rules():
        shown = {label for text in r["annotations"].values()
                 for label in RULE_LABEL.findall(text)}
        try:
            check_expr(r["expr"], exported, used, shown)
        except AssertionError as exc:
            problems.append(f"{r['alert']}: {exc}")
    assert not problems, "\n".join(problems)
    assert {"up", "ckptd_unsafe_seconds", "ckptd_errors_total", "ckptd_degraded",
            "ckptd_disk_free_bytes", "ckptd_min_free_bytes", "ckptd_root_held",
            "ckptd_invalid_checkpoints", "ckptd_preflight_warning"} <= used


@pytest.mark.skipif(PROMTOOL is None, reason="promtool (Prometheus' own checker) not on PATH")
def test_promtool_checks_the_rules_and_runs_their_unit_tests() -> None:
    """Where Prometheus' promtool is at hand: its own check, and ckptd-rules.test.yaml (each
    alert fires on the series it watches once its `for` has passed, quiet before)."""
    assert PROMTOOL is not None
    for args in (["check", "rules", RULES.name], ["test", "rules", "ckptd-rules.test.yaml"]):
        done = subprocess.run([PROMTOOL, *args], cwd=RULES.parent, capture_output=True,
                              text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("expr, why", [
    ("ckptd_no_such_metric", "no series"),
    ('ckptd_latest_step{stage="x"}', "no label 'stage'"),
    ("sum by (kind) (ckptd_queue_depth)", "not labels of"),
    ("ckptd_errors", "no series"),  # a counter is queried by its _total series
    ("ckptd_time_to_safe_seconds", "no series"),  # a histogram by _bucket/_sum/_count
    ('sum without (reason) (ckptd_latest_step{root="r1"})', "not labels of"),
    ("ckptd_up > on (root) ckptd_degraded", "not labels of both sides"),
])
def test_the_check_refuses_what_the_daemon_does_not_export(exported: Exported, expr: str,
                                                           why: str) -> None:
    with pytest.raises(AssertionError, match=re.escape(why)):
        check_expr(expr, exported, set())


def test_a_legend_or_annotation_label_must_survive_the_query(exported: Exported) -> None:
    with pytest.raises(AssertionError, match="gives no label"):
        check_expr("max by (root) (ckptd_unsafe_seconds)", exported, set(), {"instance"})
    with pytest.raises(AssertionError, match="not valid PromQL"):
        check_expr("sum(rate(ckptd_errors_total[5m])", exported, set())
