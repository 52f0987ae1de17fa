"""The plain top-level values of a torch file's pickle, read from the file's first bytes only.

`torch.save` writes the archive's `data.pkl` as the zip's first member, stored, so the pickle
starts right after the first local header: a count the framework recorded (DeepSpeed's
`dp_world_size`) can be read without reading the tensors. The pickle is walked by picklescan
and read with inert stand-ins: nothing of it runs. Anything unexpected means "not known".
"""

from __future__ import annotations

import io
import os

from ckptd.errors import ValidationFailed
from ckptd.formats import picklescan, torchpickle, zipdir
from ckptd.model import PlainValue

# Enough for the pickle of a large model's DeepSpeed model states (parameter names, shapes and
# tensor references: a few hundred KiB for 70B); a longer pickle is "not known".
HEAD_BYTES = 4 << 20


def leading_fields(head: bytes, what: str = "torch file") -> dict[str, PlainValue] | None:
    """The plain top-level values of the pickle that begins `head` (a torch zip's first bytes);
    None when `head` does not start with a stored `data.pkl` whose pickle ends within it."""
    size = zipdir.LOCAL_HEADER.size
    if len(head) < size or head[:4] != zipdir.LOCAL_MAGIC:
        return None
    f = zipdir.LOCAL_HEADER.unpack_from(head)
    method, name_len, extra_len = int(f[3]), int(f[9]), int(f[10])
    name = head[size:size + name_len]
    if method != 0 or not (name == b"data.pkl" or name.endswith(b"/data.pkl")):
        return None
    body = io.BytesIO(head[size + name_len + extra_len:])
    try:
        picklescan.scan_pickle(body, what, allowed=None)
        return torchpickle.read_torch_pickle(body.getvalue()[:body.tell()], what).fields
    except ValidationFailed:
        return None  # cut short by the head's end, or not a pickle: not known from here


def read_leading_fields(path: str | os.PathLike[str], limit: int = HEAD_BYTES
                        ) -> dict[str, PlainValue] | None:
    """`leading_fields` of the file at `path`, reading at most `limit` bytes."""
    try:
        with open(path, "rb") as f:
            head = f.read(limit)
    except OSError:
        return None
    return leading_fields(head, os.fspath(path))
