"""The docs keep up with the code: every log event the daemon emits is listed in
docs/OPERATIONS.md and every listed one is emitted; links lead to files and headings; the
modules, services, metrics, stages and names the docs quote exist; DESIGN.md's package map is
the tree, each package's docstring names its modules and no module of another package, and
the modules docstrings quote exist; TESTING.md names the tests that reach into the daemon.
Each failure names the doc line. Numbers: test_doc_numbers.py; config keys and defaults:
test_doc_config.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from support.docs import DOCS, ROOT, SPAN, SPEC, all_docs, doc_lines, where

from ckptd.lifecycle.table import Stage
from ckptd.service.metrics import Metrics

LOG_CALL = re.compile(r"\.(?:info|warning|error|debug|exception)\(\s*\"([a-z]+_[a-z0-9_]+)\"")
SYNC_CHANGE = re.compile(r"SyncChange\(\"([a-z_]+)\"")
CONDITIONAL = re.compile(r"\"([a-z]+_[a-z_]+)\" if [a-z_.]+ else \"([a-z]+_[a-z_]+)\"")


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
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets) and \
                    isinstance(node.value, ast.List | ast.Tuple):  # names served lazily too
                out.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
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


# -- tests wait on events, not the clock ---------------------------------------------------------

# The only sleeps a test may take outside a poll loop with a deadline: each makes something
# slow on purpose (a writer, a disk, a backend call) or gives files distinct coarse mtimes.
# None waits for the daemon: that is `support.wait` (wait_until, wait_scans) or an event.
SLEEPS_ALLOWED = {
    ("codec/test_codec_threads.py", "_CountingPool.submit.run"):
        "each block's decode made slow, so a caller returning without waiting for its blocks "
        "would still see them running",
    ("frameworks/scripts/deepspeed_train.py", "slow_writes.save"):
        "a rank writing slowly, one straggling after `latest`: a kill lands mid-save",
    ("frameworks/scripts/integration_snippet.py", "counted.hook"):
        "training steps paced so a preemption signal lands mid-run, between a few saves",
    ("frameworks/scripts/hf_train.py", "slow_disk.save"):
        "a slow disk under the trainer's save: a kill lands mid-write",
    ("frameworks/scripts/lightning_train.py", "main.slow"):
        "a slow save under Lightning: a kill lands mid-write",
    ("frameworks/scripts/megatron_train.py", "_hold_commit.slow"):
        "ranks stalling before the commit: a kill lands before .metadata",
    ("frameworks/test_dcp.py", "test_a_dcp_save_copied_in_with_cp_r_becomes_valid"):
        "files copied one after another get distinct (coarse) mtimes, as `cp -r` gives them",
    ("layouts/test_layouts_real.py", "test_dcp_copied_with_cp_r_completes"):
        "files copied one after another get distinct (coarse) mtimes, as `cp -r` gives them",
    ("e2e/test_first_hour.py", "test_a_new_save_of_a_gone_step_with_fewer_files_is_a_new_save"):
        "file mtimes are coarse: the new save's must fall after the deletion the daemon saw",
    ("backends/test_backends.py", "GateReader.read"): "a read that lingers: overlapping puts show",
    ("restore/test_restore.py", "Counting.get"): "a get that lingers: concurrent gets overlap",
    ("retention/test_retention_service.py", "OverlapRecorder.delete"):
        "a delete that lingers: overlapping retention runs would show",
    ("retention/test_retention_service.py",
     "test_run_now_callers_and_background_runs_never_overlap.background"):
        "a background asker paced across the callers' runs (a load, not a wait)",
    ("stages/test_upload.py", "test_requests_in_flight_stay_within_concurrency.pause"):
        "a put that lingers: overlapping puts show up as in flight together",
}


def _sleeps_outside_polls(tree: ast.Module) -> list[tuple[str, int]]:
    """(qualified function name, line) of each `time.sleep` (or `from time import sleep`)
    call that is not inside a loop which also checks a deadline (a `*.monotonic()` or
    `perf_counter()` call, or a name with "deadline" in it, anywhere in the loop)."""
    aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
               and n.module == "time" for a in n.names if a.name == "sleep"}

    def is_sleep(node: ast.Call) -> bool:
        f = node.func
        if isinstance(f, ast.Attribute):
            return f.attr == "sleep" and isinstance(f.value, ast.Name) and f.value.id == "time"
        return isinstance(f, ast.Name) and f.id in aliases

    def polls(loop: ast.AST) -> bool:
        return any(isinstance(n, ast.Attribute) and n.attr in ("monotonic", "perf_counter")
                   or isinstance(n, ast.Name) and "deadline" in n.id for n in ast.walk(loop))

    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, scope: tuple[str, ...], loop: ast.AST | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(child, (*scope, child.name), None)
                continue
            if isinstance(child, ast.Call) and is_sleep(child) and (loop is None
                                                                    or not polls(loop)):
                found.append((".".join(scope) or "<module>", child.lineno))
            inner = child if isinstance(child, ast.While | ast.For | ast.AsyncFor) else loop
            visit(child, scope, inner)

    visit(tree, (), None)
    return found


def test_tests_wait_on_events_not_the_clock() -> None:
    """No test synchronises with the daemon by sleeping: a `time.sleep` under tests/ is inside
    a poll loop with a deadline, or made something slow on purpose (SLEEPS_ALLOWED, each with
    its reason). Every allowed entry still has its sleep."""
    tests = ROOT / "tests"
    found = {(str(p.relative_to(tests)), fn, line)
             for p in sorted(tests.rglob("*.py"))
             for fn, line in _sleeps_outside_polls(ast.parse(p.read_text(), str(p)))}
    bad = sorted(f"tests/{path}:{line} in {fn}" for path, fn, line in found
                 if (path, fn) not in SLEEPS_ALLOWED)
    assert not bad, ("fixed sleeps in tests (wait on an event with support.wait.wait_until or"
                     f" wait_scans, or say why in SLEEPS_ALLOWED): {bad}")
    stale = sorted(set(SLEEPS_ALLOWED) - {(path, fn) for path, fn, _ in found})
    assert not stale, f"SLEEPS_ALLOWED entries with no sleep left: {stale}"


# -- package and module docstrings ---------------------------------------------------------------

def _packages() -> list[Path]:
    return sorted(p for p in (ROOT / "ckptd").iterdir() if (p / "__init__.py").exists())


def _docstring(module: Path) -> str:
    return ast.get_docstring(ast.parse(module.read_text())) or ""


def _defined(module: Path) -> set[str]:
    """The top-level names a module defines itself (not those it imports)."""
    return _top_names(module) - {
        (a.asname or a.name).split(".")[0] for node in ast.parse(module.read_text()).body
        if isinstance(node, ast.Import | ast.ImportFrom) for a in node.names}


def test_package_docstrings_name_their_modules() -> None:
    """Each package's docstring names every module of the package (as DESIGN.md's package map
    does), so a module added, split or moved in shows in the package's own description."""
    unnamed = [f"ckptd/{pkg.name}/{m.name}" for pkg in _packages()
               for m in sorted(pkg.glob("*.py")) if not m.stem.startswith("_")
               and not re.search(rf"\b{m.stem}\b", _docstring(pkg / "__init__.py"))]
    assert not unnamed, f"package docstrings do not name these modules: {unnamed}"


def test_modules_a_package_docstring_names_are_there() -> None:
    """A `name` a package's docstring quotes that is the name of a module elsewhere in ckptd
    is a module of this package, or a name the package defines (a top-level module, a package
    or a layout's name is a word of its own): a module that moved away, or never lived here,
    is not described as this package's."""
    from ckptd.layouts import names

    ckptd = ROOT / "ckptd"
    modules = {m.stem for pkg in _packages() for m in pkg.glob("*.py")}
    own_words = {p.stem for p in ckptd.glob("*.py")} | {p.name for p in _packages()} | set(names())
    bad = []
    for pkg in _packages():
        here = {m.stem for m in pkg.glob("*.py")} | set().union(
            *(_defined(m) for m in pkg.glob("*.py")))
        doc = _docstring(pkg / "__init__.py")
        bad += [f"ckptd/{pkg.name}/__init__.py: `{span}`" for span in SPAN.findall(doc)
                if span in modules and span not in here | own_words]
    assert not bad, f"package docstrings name modules that are not the package's: {bad}"


def test_module_docstrings_name_modules_that_exist() -> None:
    """Every `ckptd.x.y` a module's or a package's docstring quotes exists, and so does every
    `pkg.module` (a package of ckptd, then one of its modules or names): docstrings follow
    the modules they name when those move."""
    packages = {p.name for p in _packages()} - {"torch"}  # `torch.save` is PyTorch's as often
    bad = []
    for module in sorted((ROOT / "ckptd").rglob("*.py")):
        for span in SPAN.findall(_docstring(module)):
            m = re.match(r"^((?:ckptd\.)?[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)", span)
            if m is None or (ROOT / span).is_file():  # `config.example.toml` is a file
                continue
            dotted = m.group(1)
            if not dotted.startswith("ckptd."):
                if dotted.split(".")[0] not in packages:
                    continue
                dotted = f"ckptd.{dotted}"
            if not _resolves(dotted):
                bad.append(f"{module.relative_to(ROOT)}: `{span}`")
    assert not bad, f"docstrings name modules or names that do not exist: {bad}"
