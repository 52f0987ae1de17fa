"""The docs are executable claims: the numbers, names, config keys, defaults, services, metrics,
log events and module paths that README.md, docs/*.md and the spec quote are checked against
the code here, and each failure names the doc line it is on. The code is the truth."""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from ckptd import inputs
from ckptd.api import checks, door, server
from ckptd.config import (
    Config,
    DaemonConfig,
    MetricsConfig,
    RootConfig,
    needs_restart,
    parse_config,
)
from ckptd.lifecycle.table import Stage
from ckptd.service import discovery, persist, supervisor
from ckptd.service.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SPEC = ROOT.parent / "shared" / "SPEC.md"
LOG_CALL = re.compile(r"\.(?:info|warning|error|debug|exception)\(\s*\"([a-z]+_[a-z0-9_]+)\"")
SYNC_CHANGE = re.compile(r"SyncChange\(\"([a-z_]+)\"")
CONDITIONAL = re.compile(r"\"([a-z]+_[a-z_]+)\" if [a-z_.]+ else \"([a-z]+_[a-z_]+)\"")
SPAN = re.compile(r"`([^`\n]+)`")
MiB = 1024 * 1024


def name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def where(path: Path, text: str, offset: int) -> str:
    return f"{name(path)}:{text.count(chr(10), 0, offset) + 1}"


def doc_lines(*paths: Path) -> Iterator[tuple[str, str]]:
    """(`file:line`, line) of each doc."""
    for path in paths:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            yield f"{name(path)}:{n}", line


def all_docs() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def spec() -> Path:
    if not SPEC.exists():
        pytest.skip(f"{SPEC} is not beside this checkout (a clean clone has no ../shared)")
    return SPEC


def emitted_events() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "ckptd").rglob("*.py"):
        text = path.read_text()
        names.update(LOG_CALL.findall(text))
        names.update(SYNC_CHANGE.findall(text))
        for a, b in CONDITIONAL.findall(text):
            names.update((a, b))
    return names


def test_every_log_event_is_documented() -> None:
    events = emitted_events()
    assert len(events) > 40  # the scan itself works
    doc = (DOCS / "OPERATIONS.md").read_text()
    missing = sorted(e for e in events if f"`{e}`" not in doc)
    assert not missing, f"log events not listed in docs/OPERATIONS.md: {missing}"


def test_every_documented_log_event_is_emitted() -> None:
    """The first column of OPERATIONS.md's event table names events the code emits."""
    code = "\n".join(p.read_text() for p in (ROOT / "ckptd").rglob("*.py"))
    events = emitted_events()
    table = (DOCS / "OPERATIONS.md").read_text().split("| event | when |")[1].split("\n\n")[0]
    rows = [line.split(" | ")[0] for line in table.splitlines()]
    bad = [f"`{event}`" for row in rows for event in SPAN.findall(row)
           if event not in events and f'"{event}"' not in code]
    assert len(rows) > 40, "OPERATIONS.md's event table moved"
    assert not bad, f"events documented but never emitted: {bad}"


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file."""
    heads = re.findall(r"^#+ (.+)$", doc.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_doc_links_resolve() -> None:
    """Every relative link of README.md and docs/*.md leads to a file, and to a heading there."""
    for path in all_docs():
        text = path.read_text()
        for m in re.finditer(r"\]\(([^)#:]*)(?:#([^)]*))?\)", text):
            target = path.parent / m.group(1) if m.group(1) else path
            assert target.exists(), f"{where(path, text, m.start())}: {m[1]}"
            if m.group(2) and target.suffix == ".md":
                assert m.group(2) in _anchors(target), f"{where(path, text, m.start())}: #{m[2]}"


# -- module paths ------------------------------------------------------------------------------

_DOTTED = re.compile(r"^(ckptd(?:\.[A-Za-z_]\w*)+)")
_NOT_MODULES = re.compile(r"^ckptd\.(toml|service|socket)\b")
_FILE = re.compile(r"^((?:ckptd|tests|bench|examples|packaging)/[\w/.-]*?|"
                   r"(?:api|backends|cli|cluster|codec|config|copies|formats|layouts|lifecycle|"
                   r"remote|restore|retention|service|stages|store|torch)/[\w/]+\.py)(?::\w+)?$")


def _top_names(module: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
    return out


def _resolves(dotted: str) -> bool:
    """`ckptd.a.b.name`: a package, a module, or a top-level name of one."""
    here = ROOT
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if (here / part).is_dir():
            here = here / part
        elif (here / f"{part}.py").is_file():
            rest = parts[i + 1:]
            return not rest or rest[0] in _top_names(here / f"{part}.py")
        else:
            return i > 0 and part in _top_names(here / "__init__.py")
    return True


def test_module_references_resolve() -> None:
    """Every `ckptd.x.y` and `ckptd/x/y.py` a doc names exists (modules moved: docs follow)."""
    bad = []
    for at, line in doc_lines(*all_docs()):
        for span in SPAN.findall(line):
            m = _DOTTED.match(span)
            if m and not _NOT_MODULES.match(span) and not _resolves(m.group(1)):
                bad.append(f"{at}: {m.group(1)}")
            f = _FILE.match(span)
            if f and not any((base / f.group(1)).exists() for base in (ROOT, ROOT / "ckptd")):
                bad.append(f"{at}: {f.group(1)}")
    assert not bad, f"docs name modules or files that do not exist: {bad}"


# -- numbers -----------------------------------------------------------------------------------

def _ttl_bounds() -> tuple[float, float]:
    """The hold's ttl bounds, as the handler checks them."""
    m = re.search(r'"ttl", ([\d.]+), ([\d.]+)\)', Path(server.__file__).read_text())
    assert m, "the ttl check moved: update _ttl_bounds"
    return float(m.group(1)), float(m.group(2))


# (doc, pattern with number groups, what the code says, converting each group)
Number = Callable[[str], float]
_n: Number = lambda s: float(s.replace(",", ""))  # noqa: E731
_mib: Number = lambda s: float(s) * MiB  # noqa: E731
_day: Number = lambda s: float(s) * 86400  # noqa: E731
CLAIMS: list[tuple[str, str, Callable[[], tuple[float, ...]], tuple[Number, ...]]] = [
    ("docs/CLI.md", r"body over (\d+) MiB", lambda: (server.MAX_BODY,), (_mib,)),
    ("docs/CLI.md", r"a body is at most (\d+) MiB", lambda: (server.MAX_BODY,), (_mib,)),
    ("docs/CLI.md", r"`ttl` (\d+) s to (\d+) day", _ttl_bounds, (_n, _day)),
    ("docs/CLI.md", r"long-poll \(`timeout` (\d+) to (\d+) s\)",
     lambda: (0, server.MAX_WAIT_S), (_n, _n)),
    ("docs/CLI.md", r"at most ([\d,]+) paths and (\d+) metrics",
     lambda: (checks.MAX_PATHS, checks.MAX_METRICS), (_n, _n)),
    ("docs/CLI.md", r"at most (\d+) requests are answered at once",
     lambda: (server.MAX_THREADS,), (_n,)),
    ("docs/CLI.md", r"(\d+)-deep listen backlog", lambda: (door.LISTEN_BACKLOG,), (_n,)),
    ("docs/CLI.md", r"closed after (\d+) s \(the longest idle first when ([\d,]+) are open",
     lambda: (server.IDLE_TIMEOUT_S, server.MAX_OPEN), (_n, _n)),
    ("docs/CLI.md", r"(\d+) saves in flight", lambda: (persist.MAX_IN_FLIGHT,), (_n,)),
    ("docs/CLI.md", r"long-poll, at most (\d+) s", lambda: (persist.MAX_WAIT_S,), (_n,)),
    ("docs/CLI.md", r"up to (\d+) \(each error cut at (\d+) characters",
     lambda: (discovery.MAX_BAD_SHOWN, discovery.MAX_ERROR_CHARS), (_n, _n)),
    ("docs/CLI.md", r"`MANIFEST.json` over its (\d+) MiB cap", lambda: (inputs.MANIFEST.cap,),
     (_mib,)),
    ("README.md", r"body over (\d+) MiB", lambda: (server.MAX_BODY,), (_mib,)),
    ("docs/OPERATIONS.md", r"gives in-flight stages (\d+) s to finish",
     lambda: (_daemon_constant("STOP_GRACE_S"),), (_n,)),
    ("docs/DESIGN.md", r"doubles from ([\d.]+) s up to (\d+) s \(and starts over once it ran"
     r" (\d+) s\)", lambda: (supervisor.BACKOFF_BASE_S, supervisor.BACKOFF_MAX_S,
                                 supervisor.HEALTHY_AFTER_S), (_n, _n, _n)),
    ("docs/OPERATIONS.md", r"restarted after the backoff \(([\d.]+) s doubling up to (\d+) s\)",
     lambda: (supervisor.BACKOFF_BASE_S, supervisor.BACKOFF_MAX_S), (_n, _n)),
    ("SPEC.md", r"413 \(body over (\d+) MiB\)", lambda: (server.MAX_BODY,), (_mib,)),
]


def _daemon_constant(name: str) -> float:
    m = re.search(rf"^{name}(?:, \w+)* = ([\d.]+)", (ROOT / "ckptd/daemon.py").read_text(), re.M)
    assert m, f"ckptd/daemon.py has no {name}"
    return float(m.group(1))


@pytest.mark.parametrize(("doc", "pattern", "truth", "convert"), CLAIMS,
                         ids=[f"{c[0]}:{c[1][:30]}" for c in CLAIMS])
def test_numbers_match_the_code(doc: str, pattern: str, truth: Callable[[], tuple[float, ...]],
                                convert: tuple[Number, ...]) -> None:
    path = spec() if doc == "SPEC.md" else ROOT / doc
    text = path.read_text()
    found = list(re.finditer(pattern.replace(" ", r"\s+"), text))  # however the lines wrap
    assert found, f"{doc} no longer says {pattern!r}: update the claim in tests/test_docs.py"
    want = truth()
    for m in found:
        got = tuple(f(g) for f, g in zip(convert, m.groups(), strict=True))
        assert got == want, f"{where(path, text, m.start())}: says {m.group(0)!r}, code: {want}"


# Rows of SECURITY.md's inputs table (by their first cell's start) and the cap that reads them.
INPUT_ROWS = {
    "| `LATEST`": inputs.LATEST, "| `MANIFEST.json`": inputs.MANIFEST,
    "| a node's part": inputs.PART, "| any other JSON": inputs.REMOTE_JSON,
    "| `meta.json`, `meta_<N>.json`": inputs.ROOT_META, "| `trainer_state.json`":
    inputs.TRAINER_STATE, "| DCP's `.metadata`": inputs.DCP_METADATA,
    "| DeepSpeed's `latest`": inputs.TRACKER, "| `lease.json`": inputs.LEASE,
    "| `pins.json`": inputs.PINS, "| a local compressed copy's `MANIFEST.json`": inputs.MANIFEST,
    "| a copy's upload ledger": inputs.LEDGER, "| a trash entry's journal": inputs.JOURNAL,
    "| an async save's markers": inputs.MARKER, "| `meta.json` read by": inputs.ROOT_META,
}


def test_input_caps_match_inputs_kinds() -> None:
    seen = set()
    for at, line in doc_lines(DOCS / "SECURITY.md"):
        for start, kind in INPUT_ROWS.items():
            if line.startswith(start):
                seen.add(start)
                bound = line.split(" | ")[2]
                m = re.match(r"(\d+) (KiB|MiB)", bound)
                assert m, f"{at}: the bound of {start} names no size"
                size = int(m.group(1)) * (1024 if m.group(2) == "KiB" else MiB)
                assert size == kind.cap, f"{at}: {m.group(0)}, but {kind.name}'s cap is {kind.cap}"
    assert seen == set(INPUT_ROWS), f"rows gone from SECURITY.md: {set(INPUT_ROWS) - seen}"


# -- names -------------------------------------------------------------------------------------

def service_names() -> set[str]:
    """The supervisor's services, as daemon.py adds them (`worker-N` for the stage workers)."""
    text = (ROOT / "ckptd/daemon.py").read_text()
    names = set(re.findall(r"sup\.add\(\"([a-z-]+)\"", text))
    assert "api" in names and "self.workers.names" in text
    return names | {"worker-N"}


def test_services_lists_match_the_daemon() -> None:
    names = service_names()
    table = [(at, SPAN.findall(line.split(" | ")[1])) for at, line in doc_lines(DOCS / "DESIGN.md")
             if re.match(r"\| (`ckptd-|\(prometheus\)|main)", line)]
    in_design = {s for _, spans in table for s in spans}
    assert in_design == names, f"DESIGN.md's services table {table}: code has {sorted(names)}"
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"daemon's services \(([^)]*)\)", readme)
    assert m, "README.md no longer lists the services"
    listed = {s.strip().removeprefix("and ") for s in m.group(1).replace("\n", " ").split(",")}
    assert listed == names, f"{where(ROOT / 'README.md', readme, m.start())}: {sorted(listed)}"


def test_stage_histogram_names_the_stages() -> None:
    for at, line in doc_lines(DOCS / "OPERATIONS.md"):
        if line.startswith("| `ckptd_stage_duration_seconds`"):
            listed = re.search(r"\(([a-z, ]+)\)", line)
            assert listed, at
            assert listed.group(1).split(", ") == [s.value for s in Stage], at
            return
    pytest.fail("OPERATIONS.md lists no ckptd_stage_duration_seconds")


def test_documented_metrics_exist() -> None:
    """Every `ckptd_*` metric a doc names is exported, and OPERATIONS.md's table lists each."""
    families = {f.name for f in Metrics().registry.collect() if f.name.startswith("ckptd_")}
    bad = [f"{at}: {metric}" for at, line in doc_lines(*all_docs())
           for metric in re.findall(r"`(ckptd_[a-z_]+)(?:\{[^`]*)?`", line)
           if re.sub(r"_(total|info)$", "", metric) not in families]
    assert not bad, f"metrics the code does not export: {bad}"
    doc = (DOCS / "OPERATIONS.md").read_text()
    missing = [f for f in sorted(families) if not re.search(rf"\| `{f}(_total|_info)?` \|", doc)]
    assert not missing, f"metrics missing from OPERATIONS.md's table: {missing}"


def test_restart_only_keys() -> None:
    """The keys a reload cannot apply are the ones `needs_restart` names, where docs list them."""
    old = Config()
    changed = Config.model_construct(
        daemon=old.daemon.model_copy(update={k: object() for k in type(old.daemon).model_fields}),
        metrics=old.metrics.model_copy(update={"listen": "127.0.0.1:1"}), roots=())
    keys = set(needs_restart(old, changed))
    lines = [(at, line) for at, line in doc_lines(DOCS / "OPERATIONS.md")
             if "need a restart" in line or line.startswith("| `config_reloaded`")]
    assert len(lines) == 2, lines
    for at, line in lines:
        named = {s if "." in s else f"daemon.{s}" for s in SPAN.findall(line)
                 if re.fullmatch(r"[a-z_.]+", s) and not s.startswith("config_")}
        assert named == keys, f"{at}: names {sorted(named)}; needs_restart: {sorted(keys)}"


# -- config keys and defaults ------------------------------------------------------------------

SECTIONS: dict[str, type[BaseModel]] = {"daemon": DaemonConfig, "metrics": MetricsConfig,
                                        "roots": RootConfig, "defaults": RootConfig}
_KEY = re.compile(r"^\[?((?:daemon|metrics|roots|defaults|upload|compress|retention)"
                  r"(?:\.[a-z_]+)+)\]?$")


def _key_exists(key: str) -> bool:
    first, *rest = key.split(".")
    model: Any = SECTIONS.get(first)
    if model is None:  # `upload.url`: a per-root key
        model, rest = RootConfig, [first, *rest]
    for part in rest:
        is_model = isinstance(model, type) and issubclass(model, BaseModel)
        field = model.model_fields.get(part) if is_model else None
        if field is None:
            return False
        model = field.annotation
    return True


def test_config_keys_in_docs_exist() -> None:
    docs = [d for d in all_docs() if d.name != "TESTING.md"]  # it names code, not config
    docs += [SPEC] if SPEC.exists() else []
    bad = [f"{at}: {span}" for at, line in doc_lines(*docs) for span in SPAN.findall(line)
           if (m := _KEY.match(span)) and not _key_exists(m.group(1))]
    assert not bad, f"config keys the schema does not have: {bad}"


def _parsed(tables: dict[str, Any], tmp: Path) -> Config:
    data = {k: v for k, v in tables.items() if k != "roots"}
    root = {"name": "r", "path": str(tmp / "r"), **tables.get("roots", {})}
    return parse_config({**data, "roots": [root]}, tmp)


def _value(cfg: Config, section: list[str], key: str) -> Any:
    node: Any = cfg.roots[0] if section[0] in ("defaults", "roots") else getattr(cfg, section[0])
    for part in [*section[1:], key]:
        node = getattr(node, part)
    return node


def _nest(section: list[str], key: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {key: value}
    for part in reversed(section):
        out = {part: out}
    return out


def test_spec_config_block_shows_the_defaults(tmp_path: Path) -> None:
    """SPEC.md: "The values shown are the defaults, except where a comment says e.g."."""
    text = spec().read_text()
    block = re.search(r"```toml\n(\[daemon\].*?)```", text, re.S)
    assert block, "SPEC.md has no config block"
    default = _parsed({}, tmp_path)
    section: list[str] = []
    for n, line in enumerate(block.group(1).splitlines(), text[:block.start(1)].count("\n") + 1):
        head = re.match(r"\[\[?([a-z.]+)\]\]?", line)
        if head:
            section = head.group(1).split(".")
        elif "=" in line and not re.search(r"#\s*e\.g\.\s*$", line):
            key, value = next(iter(tomllib.loads(line).items()))
            got = _value(_parsed(_nest(section, key, value), tmp_path), section, key)
            want = _value(default, section, key)
            assert got == want, f"SPEC.md:{n}: {line.strip()!r}; the default is {want!r}"


QUOTED_OR_NUMBER = set('"[-0123456789')
_LIT = r'("[^"]*"|\[\]|-?\d+(?:\.\d+)?|[a-z_]+)'


def _stated_default(key: str, comment: str) -> str | None:
    """The default `comment` states for `key`: 'Default 2.', '"" (default) = off', '("min",
    default)', 'key (default "10s")', 'Defaults: keep_last 10, ...'."""
    for pattern in (rf"`?{key}`?[^()]*\((?:[^()]*?[,;] )?default {_LIT}",
                    rf"Defaults: .*\b{key} {_LIT}", rf"Default:? {_LIT}", rf"[;,] default {_LIT}",
                    rf"{_LIT} \(default\)", rf"\({_LIT}, default\)"):
        m = re.search(pattern, comment)
        if m:
            return m.group(1)
    return None


def test_example_config_states_the_defaults(tmp_path: Path) -> None:
    """config.example.toml gives each key's default in its comment: the schema's default."""
    path = ROOT / "config.example.toml"
    default = _parsed({}, tmp_path)
    section: list[str] = []
    comment, block = "", ""
    for at, line in doc_lines(path):
        if line.startswith("#"):
            comment += " " + line.lstrip("# ")
            continue
        head = re.match(r"\[\[?([a-z.]+)\]\]?", line)
        if head:
            section, comment, block = head.group(1).split("."), "", ""
        elif "=" in line and section[0] != "roots":
            key = line.split("=")[0].strip()
            # Keys written one after another share the comment above the first of them.
            literal = _stated_default(key, comment) or _stated_default(key, block)
            block = comment or block
            assert literal is not None, f"{at}: no default stated for {key}"
            bare = literal[0] in QUOTED_OR_NUMBER or literal in ("true", "false")
            toml = literal if bare else f'"{literal}"'
            value = tomllib.loads(f"v = {toml}")
            got = _value(_parsed(_nest(section, key, value["v"]), tmp_path), section, key)
            want = _value(default, section, key)
            assert got == want, f"{at}: says {key} defaults to {literal}; the schema: {want!r}"
        comment = ""


def test_package_map_is_the_tree() -> None:
    """DESIGN.md's package map names every package and top-level module of ckptd, and only
    those: the map is `ls ckptd ckptd/*/` as it is."""
    text = (DOCS / "DESIGN.md").read_text()
    block = re.search(r"## The packages.*?```\n(.*?)```", text, re.S)
    assert block, "DESIGN.md has no package map"
    said: dict[str, str] = {}  # each name of the first column -> its description
    for line in block.group(1).splitlines():
        head = re.match(r"(\S.*?)(?: {2,}|$)", line)  # the first column
        if head:
            names = [n.strip() for n in head.group(1).split(",")]
            said.update(dict.fromkeys(names, ""))
        said.update({n: said[n] + " " + line for n in names})
    pkg = ROOT / "ckptd"
    tree = {f"{p.name}/" for p in pkg.iterdir() if (p / "__init__.py").exists()}
    tree |= {p.stem for p in pkg.glob("*.py") if not p.stem.startswith("__")}
    assert set(said) == tree, (f"DESIGN.md's package map: missing {sorted(tree - set(said))}, "
                               f"not in ckptd/ {sorted(set(said) - tree)}")
    unnamed = [f"{package}{m.stem}" for package in tree if package.endswith("/")
               for m in (pkg / package).glob("*.py") if not m.stem.startswith("_")
               and not re.search(rf"\b{m.stem}\b", said[package])]
    assert not unnamed, f"DESIGN.md's package map does not name these modules: {unnamed}"


_REACH = re.compile(r"\b(?:daemon|d)\.(supervisor|scanner|retention|metrics|discovery|leases|"
                    r"persist|effects|ctx|server|healthy|_[a-z]\w*)\b|\bDaemon\(")


def test_testing_md_names_the_tests_that_reach_in() -> None:
    """TESTING.md's "Tests that reach into the daemon" names every test file that touches a
    daemon's services or private parts (or builds a `Daemon` itself) beside InProcessDaemon."""
    text = (DOCS / "TESTING.md").read_text()
    section = text.split("## Tests that reach into the daemon", 1)[-1].split("\n## ", 1)[0]
    tests = ROOT / "tests"
    reaching = {str(p.relative_to(ROOT)) for p in tests.rglob("*.py")
                if "frameworks" not in p.parts and p.name not in ("inproc.py", "test_docs.py")
                and _REACH.search(p.read_text())}
    assert reaching, "the scan finds nothing: the pattern is stale"
    missing = sorted(f for f in reaching if f"`{f}`" not in section)
    assert not missing, f"docs/TESTING.md does not name these tests that reach in: {missing}"


# Quoted names that are not ckptd's, each with why.
NOT_OURS = {
    "settle_seconds": "SPEC.md's name for the root key `settle` (SPEC.md is not edited here)",
    "object_store": "the Rust crate obstore is built on (STORAGE.md)",
}
_SNAKE = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+")


def test_quoted_names_exist() -> None:
    """Every snake_case name a doc quotes in a code span (an event, a key, a field, a function,
    a fixture) is a word of ckptd's code, its tests, bench or packaging. INTEGRATIONS.md quotes
    the frameworks' own names and FORMAT.md its formulas: they are left out."""
    sources = [*ROOT.glob("ckptd/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/*.py"),
               *(p for p in ROOT.glob("packaging/**/*") if p.is_file()),
               ROOT / "config.example.toml"]
    words = set(re.findall(r"\w+", "\n".join(p.read_text(errors="replace") for p in sources)))
    words |= {f"{f.name}{suffix}" for f in Metrics().registry.collect()
              for suffix in ("", "_total", "_info")}
    docs = [d for d in all_docs() if d.name not in ("INTEGRATIONS.md", "FORMAT.md")]
    bad = [f"{at}: {span}" for at, line in doc_lines(*docs, *([SPEC] if SPEC.exists() else []))
           for span in SPAN.findall(line)
           if _SNAKE.fullmatch(span) and span not in words and span not in NOT_OURS]
    assert not bad, f"names quoted in the docs that the code does not have: {bad}"


def _missing_keys(model: type[BaseModel], table: dict[str, Any], at: str) -> list[str]:
    out = []
    for key, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            out += _missing_keys(sub, table.get(key, {}), f"{at}{key}.")
        elif key not in table:
            out.append(f"{at}{key}")
    return out


def test_example_config_documents_every_key() -> None:
    """config.example.toml says it documents every key: each schema key is set there."""
    example = tomllib.loads((ROOT / "config.example.toml").read_text())
    first = example["roots"][0]
    root = {**example["defaults"], "name": first["name"], "path": first["path"]}
    missing = (_missing_keys(DaemonConfig, example["daemon"], "daemon.")
               + _missing_keys(MetricsConfig, example["metrics"], "metrics.")
               + _missing_keys(RootConfig, root, "roots."))
    assert not missing, f"config.example.toml does not show: {missing}"
