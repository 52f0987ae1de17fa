"""A backend that forwards every call of the storage contract to the one it wraps: tests
subclass it and override only the calls whose behaviour they change (a refused put, an object
changed at a fixed point of a read), so a wrapper stays in step with the contract."""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO

from ckptd.backends import Backend
from ckptd.backends.base import SMALL_OBJECT_MAX, ObjectMeta, Source


class PassThrough:
    def __init__(self, inner: Backend) -> None:
        self.inner = inner

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def part_size(self) -> int:
        return self.inner.part_size

    @property
    def md5_etags(self) -> bool:
        return self.inner.md5_etags

    def put(self, key: str, src: Source, size: int | None = None, *,
            create_only: bool = False, if_match: str | None = None) -> ObjectMeta:
        return self.inner.put(key, src, size, create_only=create_only, if_match=if_match)

    def get(self, key: str, dst: BinaryIO, etag: str | None = None) -> int:
        return self.inner.get(key, dst, etag=etag)

    def get_bytes(self, key: str, limit: int = SMALL_OBJECT_MAX) -> bytes:
        return self.inner.get_bytes(key, limit)

    def get_versioned(self, key: str, limit: int = SMALL_OBJECT_MAX) -> tuple[bytes, str]:
        return self.inner.get_versioned(key, limit)

    def get_range(self, key: str, start: int, end: int, etag: str | None = None
                  ) -> bytes | memoryview:
        return self.inner.get_range(key, start, end, etag)

    def stat(self, key: str) -> ObjectMeta:
        return self.inner.stat(key)

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)
