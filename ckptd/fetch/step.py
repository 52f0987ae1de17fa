"""One committed remote step opened for reading in place: the root's remote found the way the
daemon finds it (the config, or a URL with the environment's credentials), the step chosen
(`latest` = the newest committed step whose manifest reads), its manifest, and a reader for
each of its files. Reads only; used by the loaders (`ckptd.dcp`, `ckptd.torch`, `ckptd.open`).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ckptd.backends import Backend, backend_for_upload, make_backend, wrap_backend
from ckptd.codec.decoder import read_threads, release_idle
from ckptd.errors import BadValue, ConfigError, CorruptData, NotFound
from ckptd.fetch.holds import ReaderHold, daemon_socket
from ckptd.fetch.objects import ObjectReader, ReadStats
from ckptd.fetch.source import list_remote_steps, newest_copy, read_remote_manifest
from ckptd.remote.keys import manifest_exists
from ckptd.remote.manifest import Manifest, StoredFile, step_prefix

StepArg = int | str

# Decoding threads: decoding is CPU work and fetches run on their own pool (`fetches`), so one
# per core; each keeps one block's workspace, so more would only add memory.
DEFAULT_THREADS = read_threads()


def open_backend(root: str, config: str | os.PathLike[str] | None = None,
                 remote: str | None = None) -> Backend:
    """The remote of root `root`: from `remote` (a URL, credentials and endpoint from the
    environment as for the daemon: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY,
    AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, AWS_REGION), else from the config (`config`, else
    the usual search: $CKPTD_CONFIG, /etc/ckptd/ckptd.toml)."""
    if remote:
        env = os.environ
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or ""
        region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or ""
        return wrap_backend(make_backend(remote, endpoint=endpoint, region=region))
    from ckptd.config import find_config, load_config  # pydantic: only when a config is read

    path = find_config(config)
    if path is None:
        raise ConfigError("no config found to read the remote of root "
                          f"{root!r} from: pass config= or remote=, or set CKPTD_CONFIG")
    rc = load_config(Path(path)).root(root)
    if not rc.upload.enabled:
        raise NotFound(f"root {root!r} in {path} uploads nowhere (no upload.url)")
    return backend_for_upload(rc.upload)


def choose_step(backend: Backend, root: str, step: StepArg) -> int:
    """`step` itself if committed, or for "latest" the newest committed step whose manifest
    reads (LATEST is a hint only: the manifests decide). NotFound says what was looked at."""
    if step == "latest":
        found = newest_copy(set(), set(list_remote_steps(backend, root)), backend, root)
        if found is None:
            raise NotFound(f"no committed step of {root!r} at {backend.url}")
        return found
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise BadValue(f"step must be a non-negative int or 'latest', not {step!r}")
    if not manifest_exists(backend, root, step):
        raise NotFound(f"step {step} of {root!r} is not committed at {backend.url} "
                       f"(no {step_prefix(root, step)}/MANIFEST.json)")
    return step


class RemoteStep:
    """A committed step of a root's remote, open for ranged reads of its files."""

    def __init__(self, backend: Backend, root: str, step: int, manifest: Manifest,
                 threads: int = DEFAULT_THREADS, hold: ReaderHold | None = None) -> None:
        self.backend, self.root, self.step, self.manifest = backend, root, step, manifest
        self.hold = hold  # the reader's hold on the step, ended by close()
        self.threads = max(1, threads)
        # Blocks in flight (fetched, decoding or decoded and not yet delivered) across the
        # files read at once: what bounds the reader's memory (a few blocks each way).
        self.window = 2 * self.threads + 2
        # Span requests in flight (8 MiB each, fetch.spans.SPAN): as many as decoding
        # threads, two at least. On 2 vCPUs shared with the server, 2 loaded a 1.6 GB step in
        # 4.6 s at 18 MiB over a local load's peak, 4 in 5.1 s at 62 MiB over it (measured).
        self.fetches = max(2, self.threads)
        self.stats = ReadStats()
        self._files = {f.path: f for f in manifest.files}
        self._readers: dict[str, ObjectReader] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._fetch: ThreadPoolExecutor | None = None
        # Decoded blocks in flight across every file read at once: what bounds the memory.
        self.slots = threading.Semaphore(self.window)
        self._lock = threading.Lock()

    @classmethod
    def open(cls, root: str, step: StepArg = "latest", *,
             config: str | os.PathLike[str] | None = None, remote: str | None = None,
             threads: int = DEFAULT_THREADS) -> RemoteStep:
        backend = open_backend(root, config, remote)
        return cls.at(backend, root, step, socket=daemon_socket(config, remote),
                      threads=threads)

    @classmethod
    def at(cls, backend: Backend, root: str, step: StepArg = "latest", *,
           socket: str | None = None, threads: int = DEFAULT_THREADS) -> RemoteStep:
        """The step opened through `backend`. Errors keep their class, as `ckptd restore`
        reads the same manifest: NotFound (not committed, gone), CorruptData (malformed),
        a storage error (denied, unreachable) as the backend raised it."""
        n = choose_step(backend, root, step)
        # Held before the manifest is read: a step deleted before the hold landed is not
        # read at all, one held is not deleted while it is read (docs/REMOTE_LOAD.md).
        hold = ReaderHold(backend, root, n, socket=socket)
        try:
            manifest = read_remote_manifest(backend, root, n)
        except CorruptData as exc:
            hold.close()
            raise type(exc)(f"step {n} of {root!r}: {exc}") from None
        except BaseException:
            hold.close()
            raise
        return cls(backend, root, n, manifest, threads, hold)

    @property
    def url(self) -> str:
        return f"{self.backend.url.rstrip('/')}/{step_prefix(self.root, self.step)}"

    def files(self) -> list[StoredFile]:
        return list(self.manifest.files)

    def stored(self, path: str) -> StoredFile:
        """The manifest entry of original file `path`; NotFound naming the step otherwise."""
        f = self._files.get(path)
        if f is None:  # a path inside the step's checkpoint ("model.safetensors" for
            # "step-1000/model.safetensors"), when exactly one file ends so
            ends = [g for p, g in self._files.items() if p.endswith("/" + path)]
            if len(ends) == 1:
                return ends[0]
            raise NotFound(f"{self.url}: the step has no file {path!r}"
                           + (f" (several end so: {sorted(g.path for g in ends)[:4]})"
                              if ends else ""))
        return f

    def reader(self, path: str) -> ObjectReader:
        f = self.stored(path)
        with self._lock:
            return self._reader(f.path, f)

    def _reader(self, path: str, f: StoredFile) -> ObjectReader:
        found = self._readers.get(path)
        if found is None:
            key = f"{step_prefix(self.root, self.step)}/{f.key}"
            found = ObjectReader(self.backend, key, f, self._executor(), self.stats,
                                 window=self.window, slots=self.slots,
                                 fetcher=self._fetch_executor())
            self._readers[path] = found
        return found

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, "ckptd-read")
        return self._pool

    def _fetch_executor(self) -> ThreadPoolExecutor:
        if self._fetch is None:
            self._fetch = ThreadPoolExecutor(self.fetches, "ckptd-fetch")
        return self._fetch

    def close(self) -> None:
        for pool in (self._pool, self._fetch):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self._pool = self._fetch = None
        self.release_hold()
        release_idle()  # the decoders' block arrays: a training process wants them back

    def release_hold(self) -> None:
        """End the reader's hold on the step (the read is over; close() does it too)."""
        if self.hold is not None:
            self.hold.close()

    def __enter__(self) -> RemoteStep:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
