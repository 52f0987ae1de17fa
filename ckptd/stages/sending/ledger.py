"""The upload ledger: which remote objects this node put from which local files
(`.upload-ledger.jsonl` in a step's objects dir), so a re-run skips them without reading
anything.

Owns the ledger's file format; writes only the ledger, never an object or the store.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
from pathlib import Path
from typing import Any

from ckptd import inputs
from ckptd.backends.base import ObjectMeta, check_key, same_object
from ckptd.errors import BadInput, CkptdError
from ckptd.log import get_logger

LEDGER_NAME = ".upload-ledger.jsonl"
_LEDGER_FORMAT = "ckptd-upload-ledger/2"
_LEGACY_NAME = ".upload-ledger.json"  # the whole-document ledger of earlier versions
_LEGACY_FORMAT = "ckptd-upload-ledger/1"


class Ledger:
    """Which remote objects this node put from which local files (`.upload-ledger.jsonl` in the
    step's objects dir), so a re-run skips them without reading anything. Only a hint: a lost
    or stale entry costs a re-check or a re-send, never a wrong skip, since an entry counts
    only while the local file (size, mtime, inode) and the remote object (etag, else mtime)
    are both unchanged. Written without fsync for the same reason.

    Append-only JSON lines, so recording an object costs one small write whatever the step's
    size: a header line (format and backend URL), then one line per object put or proven (a
    later line for a key replaces an earlier one). A torn last line (a kill mid-write) and any
    unparsable line are ignored; a ledger of another format or URL is started afresh. The
    whole-document ledger of earlier versions (`.upload-ledger.json`) is read as well, and
    folded into the new file when that is first written.
    """

    def __init__(self, path: Path, url: str, objects: dict[str, Any], valid: int = 0,
                 legacy: Path | None = None) -> None:
        self.path = path
        self.url = url
        self.objects = objects
        self._valid = valid  # bytes of whole lines, header first; 0: (re)write from scratch
        self._legacy = legacy  # an old-format ledger whose entries `objects` holds
        self._fd = -1
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: Path, url: str) -> Ledger:
        legacy = path.with_name(_LEGACY_NAME)
        objects = _read_legacy(legacy, url)
        valid = _read_lines(path, url, objects)
        return cls(path, url, objects, valid, legacy if legacy.exists() else None)

    def vouches(self, key: str, fingerprint: list[int], meta: ObjectMeta) -> bool:
        entry = self.objects.get(key)
        if not isinstance(entry, dict) or entry.get("local") != fingerprint:
            return False
        try:
            then = ObjectMeta(key, int(entry["size"]), float(entry["mtime"]), entry["etag"])
        except (KeyError, TypeError, ValueError):
            return False
        return same_object(then, meta)

    def sent(self) -> dict[str, ObjectMeta]:
        """Every object the ledger says this copy's save put or proved, as it was then; an
        entry that is malformed or names no valid key (the ledger lies in the root) is left
        out."""
        out: dict[str, ObjectMeta] = {}
        for key, entry in self.objects.items():
            try:
                check_key(key)
                out[key] = ObjectMeta(key, int(entry["size"]), float(entry["mtime"]),
                                      entry["etag"] if isinstance(entry["etag"], str) else None)
            except (CkptdError, KeyError, TypeError, ValueError):
                continue
        return out

    def record(self, key: str, fingerprint: list[int], meta: ObjectMeta) -> None:
        entry = {"local": fingerprint, "size": meta.size, "mtime": meta.mtime, "etag": meta.etag}
        line = _line({"key": key, **entry})
        with self._lock:
            try:
                self._append(line)
            except OSError as exc:
                self._close()  # the next record reopens and cuts what this one left
                get_logger().debug("upload_ledger_unwritable", path=str(self.path),
                                   error=str(exc))
            self.objects[key] = entry  # after: a new file's first write holds the others

    def close(self) -> None:
        with self._lock:
            self._close()

    def _append(self, line: bytes) -> None:
        if self._fd < 0:
            self._open()
        if os.write(self._fd, line) != len(line):
            raise OSError(errno.ENOSPC, "short write")
        self._valid += len(line)

    def _open(self) -> None:
        """Open for appending after the last whole line; a new file starts with its header
        and the old-format ledger's entries (the old file then goes)."""
        # Never through a link (it could lead out of the root) and never waiting on a FIFO.
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(self.path, flags | os.O_NONBLOCK, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, f"{self.path} is not a regular file")
            os.ftruncate(fd, self._valid)
            if self._valid == 0:
                start = _line({"format": _LEDGER_FORMAT, "url": self.url}) + b"".join(
                    _line({"key": k, **e}) for k, e in self.objects.items() if isinstance(e, dict))
                if os.write(fd, start) != len(start):
                    raise OSError(errno.ENOSPC, "short write")
                self._valid = len(start)
                if self._legacy is not None:  # folded in: the new file holds its entries
                    self._legacy.unlink(missing_ok=True)
                    self._legacy = None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _line(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def _read_lines(path: Path, url: str, objects: dict[str, Any]) -> int:
    """Add the entries of the JSON-lines ledger at `path` to `objects`; return the length of
    its whole lines, or 0 when it is missing, unreadable, or of another format or URL."""
    try:
        data = inputs.read_file(path, inputs.LEDGER)
    except (OSError, BadInput):
        return 0  # missing, a link, a FIFO, over its cap: started afresh, it only saves work
    end = data.rfind(b"\n") + 1  # past the last whole line: what follows is torn
    lines = data[:end].splitlines()
    if not lines or _header(lines[0]) != (_LEDGER_FORMAT, url):
        return 0
    for raw in lines[1:]:
        try:
            doc = json.loads(raw)
            key = doc.pop("key")
        except (ValueError, TypeError, KeyError, AttributeError):
            continue  # one damaged line hides only its own entry
        if isinstance(key, str):
            objects[key] = doc
    return end


def _header(raw: bytes) -> tuple[Any, Any]:
    try:
        doc = json.loads(raw)
        return doc.get("format"), doc.get("url")
    except (ValueError, AttributeError):
        return None, None


def _read_legacy(path: Path, url: str) -> dict[str, Any]:
    """The entries of an old whole-document ledger for `url`, else none."""
    try:
        doc = inputs.read_json(path, inputs.LEDGER)
        if doc.get("format") == _LEGACY_FORMAT and doc.get("url") == url:
            return dict(doc["objects"])
    except (OSError, BadInput, ValueError, TypeError, KeyError, AttributeError):
        pass
    return {}
