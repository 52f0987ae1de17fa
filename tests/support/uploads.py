"""A checkpoint step's objects built as the compress stage leaves them, the S3 test server's
backend, a recording wrapper around a backend, and a daemon's upload config. Holds no tests."""

from __future__ import annotations

import json
import os
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from ckptd import fileio
from ckptd.backends import Backend, ObjectMeta, ObstoreBackend
from ckptd.backends.base import SMALL_OBJECT_MAX, Source
from ckptd.client import Client
from ckptd.codec import make_encoder
from ckptd.errors import (
    TransientError,
)
from ckptd.remote.manifest import MANIFEST_NAME, Manifest, StoredFile
from support.wait import wait_until

if TYPE_CHECKING:
    from s3server import S3Server


MiB = 1024 * 1024


PART = 5 * MiB  # S3's smallest part: multipart objects stay small


ROOT = "llm"


def random_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def weights(n_floats: int, seed: int) -> bytes:
    """fp32 'weights': compressible the way real ones are (sign/exponent bytes repeat)."""
    return np.random.default_rng(seed).standard_normal(n_floats, dtype=np.float32).tobytes()


def default_files() -> dict[str, bytes]:
    return {
        "model.pt": weights(3 * MiB // 4, seed=1),  # ~2.8 MB stored: single part
        "optim/rank0.pt": random_bytes(12 * MiB, seed=2),  # 3 parts of 5 MiB: multipart
        "meta.json": json.dumps({"step": 1, "lr": 3e-4}).encode(),
        "empty.bin": b"",
    }


def make_step(
    base: Path, step: int, files: dict[str, bytes] | None = None, codec: str = "zstd",
    layout: str = "native",
) -> tuple[Path, Manifest]:
    """`<base>/objects/step-<N>/` with one encoded object per file and MANIFEST.json."""
    files = default_files() if files is None else files
    objects = base / "objects" / f"step-{step}"
    originals = base / "orig" / f"step-{step}"
    stored = [_encode(originals, objects, rel, data, codec) for rel, data in files.items()]
    manifest = Manifest(ROOT, step, layout, tuple(stored), metrics={"loss": 1.5})
    (objects / MANIFEST_NAME).write_bytes(manifest.to_bytes())
    return objects, manifest


def _encode(originals: Path, objects: Path, rel: str, data: bytes, codec: str) -> StoredFile:
    src = originals / rel
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_bytes(data)
    tmp = objects / f".tmp-{rel.replace('/', '_')}"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as out:
        enc = make_encoder(codec, out)
        digest = fileio.HashSink()
        fileio.read_pass(src, [digest, enc])
    key = rel + enc.suffix
    (objects / key).parent.mkdir(parents=True, exist_ok=True)
    os.rename(tmp, objects / key)
    return StoredFile(rel, len(data), digest.digest, fileio.HASH_ALG, enc.codec,
                      enc.stored_size, key)


def s3_backend(server: S3Server, url: str, endpoint: str = "", **kw: Any) -> ObstoreBackend:
    """An ObstoreBackend on the test server; obstore's own retries off so ours decide."""
    options: dict[str, Any] = {
        "endpoint": endpoint or server.endpoint,
        "region": server.region,
        "access_key_id": server.access_key,
        "secret_access_key": server.secret_key,
        "part_size": PART,
        "concurrency": 2,
        "request_retries": 0,
        "read_timeout_s": 5.0,
        "request_timeout_s": 30.0,
    }
    options.update(kw)
    return ObstoreBackend(url, **options)


class Recording:
    """A Backend around a real one that records each call and can fail chosen ones:
    `fail(op, key)` returns an exception to raise instead of doing the call, or None."""

    def __init__(
        self, inner: Backend, fail: Callable[[str, str], Exception | None] | None = None
    ) -> None:
        self.inner = inner
        self.calls: list[tuple[str, str]] = []
        self.fail = fail
        self.in_flight = 0
        self.peak_in_flight = 0
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def part_size(self) -> int:
        return self.inner.part_size

    @property
    def md5_etags(self) -> bool:
        return self.inner.md5_etags

    def _call(self, op: str, key: str) -> None:
        with self._lock:
            self.calls.append((op, key))
        if self.fail is not None and (exc := self.fail(op, key)) is not None:
            raise exc

    def puts(self) -> list[str]:
        return [k for op, k in self.calls if op == "put"]

    def put(
        self,
        key: str,
        src: Source,
        size: int | None = None,
        *,
        create_only: bool = False,
        if_match: str | None = None,
    ) -> ObjectMeta:
        with self._lock:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            self._call("put", key)
            return self.inner.put(key, src, size, create_only=create_only, if_match=if_match)
        finally:
            with self._lock:
                self.in_flight -= 1

    def get(self, key: str, dst: BinaryIO, etag: str | None = None) -> int:
        self._call("get", key)
        return self.inner.get(key, dst, etag=etag)

    def get_bytes(self, key: str, limit: int = SMALL_OBJECT_MAX) -> bytes:
        self._call("get_bytes", key)
        return self.inner.get_bytes(key, limit)

    def get_versioned(self, key: str, limit: int = SMALL_OBJECT_MAX) -> tuple[bytes, str]:
        self._call("get_versioned", key)
        return self.inner.get_versioned(key, limit)

    def stat(self, key: str) -> ObjectMeta:
        self._call("stat", key)
        return self.inner.stat(key)

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        self._call("list", prefix)
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self._call("delete", key)
        self.inner.delete(key)


def keys_of(backend: Backend, step: int) -> set[str]:
    prefix = f"{ROOT}/step-{step}/"
    return {m.key[len(prefix):] for m in backend.list(f"{ROOT}/step-{step}")}


def fail_on(suffix: str) -> Callable[[str, str], Exception | None]:
    def fail(op: str, key: str) -> Exception | None:
        if op == "put" and key.endswith(suffix):
            return TransientError(f"injected: connection reset putting {key}")
        return None

    return fail


def upload_cfg(url: str, s3: Any = None, **extra: Any) -> dict[str, Any]:
    up: dict[str, Any] = {"url": url, **extra}
    if s3 is not None:
        up.update(endpoint=s3.endpoint, region=s3.region, access_key_id=s3.access_key,
                  secret_access_key=s3.secret_key)
    return up


def wait_remote(c: Client, root: str, step: int, timeout: float = 60) -> dict[str, Any]:
    def uploaded() -> dict[str, Any] | None:
        rec = c.checkpoint(root, step)
        return rec if rec and rec["remote"] == "uploaded" else None

    return wait_until(uploaded, timeout, f"{root} step {step} uploaded")
