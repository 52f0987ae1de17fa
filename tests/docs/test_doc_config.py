"""Config as the docs show it is the schema's: every key a doc names exists, the defaults
config.example.toml and the spec state are the schema's defaults, the example shows every key,
and the keys a reload cannot apply are the ones `needs_restart` names."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from support.docs import DOCS, ROOT, SPAN, SPEC, all_docs, doc_lines, spec

from ckptd.config import (
    Config,
    DaemonConfig,
    MetricsConfig,
    RootConfig,
    needs_restart,
    parse_config,
)


def test_restart_only_keys() -> None:
    """The keys a reload cannot apply are the ones `needs_restart` names, where docs list them."""
    old = Config()
    changed = Config.model_construct(
        daemon=old.daemon.model_copy(update={k: object() for k in type(old.daemon).model_fields}),
        metrics=old.metrics.model_copy(update={"listen": "127.0.0.1:1"}),
        memory=old.memory.model_copy(update={k: object() for k in type(old.memory).model_fields
                                             if k != "keep"}), roots=())
    keys = set(needs_restart(old, changed))
    lines = [(at, line) for at, line in doc_lines(DOCS / "OPERATIONS.md")
             if "need a restart" in line or line.startswith("| `config_reloaded`")]
    assert len(lines) == 2, lines
    for at, line in lines:
        named = {s if "." in s else f"daemon.{s}" for s in SPAN.findall(line)
                 if re.fullmatch(r"[a-z_.]+", s) and not s.startswith("config_")}
        assert named == keys, f"{at}: names {sorted(named)}; needs_restart: {sorted(keys)}"




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
