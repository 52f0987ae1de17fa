"""Every file primitive once: the bounded read pass (`reading`), atomic writes and fsync
(`durable`), page-cache advice (`cache`), members opened beneath a root and trees removed without
following a link (`paths`). Knows nothing of checkpoint formats, the store or stages.
"""

from ckptd.fileio.cache import WRITEBACK_STEP, DropBehindReader, advise, drop_cache
from ckptd.fileio.durable import (
    FSYNC_THREADS,
    TEMP_PREFIX,
    DurableWriter,
    atomic_write_bytes,
    atomic_write_json,
    fsync_dir,
    fsync_file,
    fsync_many,
    temp_name,
    write_error,
)
from ckptd.fileio.paths import open_beneath, remove_tree, safe_join
from ckptd.fileio.reading import (
    CHUNK_SIZE,
    HASH_ALG,
    HashSink,
    Sink,
    open_file_limit,
    pread_exact,
    raise_open_file_limit,
    read_pass,
)

__all__ = [
    "CHUNK_SIZE",
    "FSYNC_THREADS",
    "HASH_ALG",
    "TEMP_PREFIX",
    "WRITEBACK_STEP",
    "DropBehindReader",
    "DurableWriter",
    "HashSink",
    "Sink",
    "advise",
    "atomic_write_bytes",
    "atomic_write_json",
    "drop_cache",
    "fsync_dir",
    "fsync_file",
    "fsync_many",
    "open_beneath",
    "open_file_limit",
    "pread_exact",
    "raise_open_file_limit",
    "read_pass",
    "remove_tree",
    "safe_join",
    "temp_name",
    "write_error",
]
