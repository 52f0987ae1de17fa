"""The docs keep up with the code: every log event name the daemon can emit is listed in
docs/OPERATIONS.md (operators query journald on them), and every doc the README links exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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
    doc = (ROOT / "docs" / "OPERATIONS.md").read_text()
    missing = sorted(e for e in events if f"`{e}`" not in doc)
    assert not missing, f"log events not listed in docs/OPERATIONS.md: {missing}"


def test_readme_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#:]+)\)", readme):
        assert (ROOT / target).exists(), target
