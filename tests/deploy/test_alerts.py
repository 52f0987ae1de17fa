"""What operators expect of the alerting rules (deploy/prometheus/ckptd-rules.yaml) and the
dashboard (deploy/grafana/ckptd.json) beyond their PromQL: each alert leads to its runbook in
docs/OPERATIONS.md, the invalid-checkpoint and next-save alerts are there, the rules' unit
tests (ckptd-rules.test.yaml) expect each alert's annotations as the rules give them, and the
scrape job's name is one thing to change: one substitution in the rules, a variable in the
dashboard. That the expressions name only what a real daemon exports is tests/test_dashboards.py's
check; promtool runs the unit tests there where it is installed."""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser as pql
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "ckptd-rules.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "ckptd-rules.test.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "ckptd.json"
OPERATIONS = ROOT / "docs" / "OPERATIONS.md"
GRAFANA_INTERVALS = re.compile(r"\$__(rate_interval|interval|range)\b")


def rules(text: str | None = None) -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text() if text is None else text)
    return [r for group in doc["groups"] for r in group["rules"]]


def selectors(node: Any) -> Iterator[Any]:
    """Every vector selector of a PromQL AST."""
    if isinstance(node, pql.VectorSelector):
        yield node
    elif isinstance(node, pql.MatrixSelector):
        yield node.vector_selector
    elif isinstance(node, pql.ParenExpr | pql.UnaryExpr | pql.SubqueryExpr):
        yield from selectors(node.expr)
    elif isinstance(node, pql.Call):
        for arg in node.args:
            yield from selectors(arg)
    elif isinstance(node, pql.AggregateExpr):
        yield from selectors(node.expr)
        if node.param is not None:
            yield from selectors(node.param)
    elif isinstance(node, pql.BinaryExpr):
        yield from selectors(node.lhs)
        yield from selectors(node.rhs)


def job_matchers(expr: str) -> list[list[tuple[str, str]]]:
    """For each selector of `expr`: its matchers on `job`, as (operator, value)."""
    tree = pql.parse(GRAFANA_INTERVALS.sub("5m", expr))
    ops = {"MatchOp.Equal": "=", "MatchOp.Re": "=~"}  # the parser's enum is not hashable
    return [[(ops.get(str(m.op), str(m.op)), m.value) for m in vs.matchers.matchers
             if m.name == "job"] for vs in selectors(tree)]


def names(expr: str) -> set[str]:
    return {vs.name for vs in selectors(pql.parse(expr))}


def anchors(doc: Path) -> list[str]:
    """GitHub's heading anchors of a markdown file, in order."""
    heads = re.findall(r"^#+ (.+)$", doc.read_text(), re.M)
    return [re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads]


def repository() -> str:
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    return str(urls["Repository"]).rstrip("/")


# -- runbooks ----------------------------------------------------------------------------------


def test_every_alert_leads_to_its_runbook_in_operations() -> None:
    heads = anchors(OPERATIONS)
    section = heads.index("alert-runbooks")
    runbooks = heads[section + 1:heads.index("health", section)]
    base = f"{repository()}/blob/main/docs/OPERATIONS.md#"
    alerts = rules()
    for r in alerts:
        url = r["annotations"].get("runbook_url", "")
        assert url == base + r["alert"].lower(), (r["alert"], url)
        assert url.removeprefix(base) in runbooks, f"{r['alert']}: no runbook heading for {url}"
    assert sorted(runbooks) == sorted(r["alert"].lower() for r in alerts), \
        "a runbook for an alert that is not there"


def test_the_invalid_checkpoint_and_next_save_alerts_watch_their_series() -> None:
    by_name = {r["alert"]: r for r in rules()}
    invalid = by_name["CkptdInvalidCheckpoints"]
    assert names(invalid["expr"]) == {"ckptd_invalid_checkpoints"}
    assert "min_over_time" in invalid["expr"]  # a rise, not the invalid ones kept for inspection
    fit = by_name["CkptdNextSaveWontFit"]
    assert names(fit["expr"]) == {"ckptd_preflight_warning"}
    assert re.search(r"==\s*1\b", fit["expr"]), fit["expr"]
    for r in (invalid, fit):
        assert r["labels"]["severity"] == "warning"
        assert "$labels.root" in r["annotations"]["summary"]


def test_the_rule_unit_tests_expect_every_alert_with_its_runbook() -> None:
    """ckptd-rules.test.yaml names each alert firing at least once, expecting the rule's own
    runbook_url (promtool compares every annotation)."""
    by_name = {r["alert"]: r for r in rules()}
    fired: dict[str, list[dict[str, Any]]] = {}
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            for alert in check.get("exp_alerts") or []:
                fired.setdefault(check["alertname"], []).append(alert)
    assert set(fired) == set(by_name), "an alert without a firing case, or a case without one"
    for name, alerts in fired.items():
        for alert in alerts:
            assert alert["exp_annotations"]["runbook_url"] == \
                by_name[name]["annotations"]["runbook_url"], name


# -- the scrape job's name ---------------------------------------------------------------------


def test_every_rule_selector_names_the_job_so_one_substitution_renames_it() -> None:
    text = RULES.read_text()
    for r in rules(text):
        for matchers in job_matchers(r["expr"]):
            assert matchers == [("=", "ckptd")], (r["alert"], matchers)
    renamed = text.replace('job="ckptd"', 'job="training-nodes"')
    assert 'job="ckptd"' not in renamed
    for r in rules(renamed):
        for matchers in job_matchers(r["expr"]):
            assert matchers == [("=", "training-nodes")], (r["alert"], matchers)


def test_the_dashboard_picks_the_scrape_job_by_a_variable() -> None:
    doc = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    job = variables["job"]
    assert job["type"] == "query" and job["includeAll"] and job["multi"]
    assert job["query"]["query"] == "label_values(ckptd_up, job)"
    order = [v["name"] for v in doc["templating"]["list"]]
    assert order.index("job") < order.index("instance") < order.index("root")
    for name in ("instance", "root"):  # each narrows to the jobs picked
        query = variables[name]["query"]["query"]
        assert 'job=~"$job"' in query, (name, query)
    exprs = [t["expr"] for p in doc["panels"] for q in [p, *p.get("panels", [])]
             for t in q.get("targets", [])]
    assert len(exprs) > 20
    for expr in exprs:
        for matchers in job_matchers(expr):
            assert matchers == [("=~", "$job")], (expr, matchers)
    assert not re.search(r'job\s*=\s*\\?"(?!\$job)', json.dumps(doc)), "a job name written in"
