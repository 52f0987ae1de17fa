"""Compression codecs for stored checkpoint files: `none`, `zstd`, `zstd-bytegroup`, `auto`, and
any `register` adds.

Owns the streaming encode/decode API (`encoder`, `decoder`, and `zstdframes` for codec `zstd`
with its `seektable`), the block index (`index`) and the container format (`frame`; per block
`blocks`, `planes` and `nibbles`, compiled or numpy as `kernels` says; `buffers` kept between
files) (docs/FORMAT.md); does no file or network I/O of its own (callers hand it chunks,
streams or a fetch function).
"""

from __future__ import annotations

from typing import BinaryIO, Protocol

from ckptd import model
from ckptd.codec import buffers
from ckptd.codec.blocks import BlockPolicy
from ckptd.codec.decoder import decode_stream, read_threads
from ckptd.codec.encoder import (
    BLOCK_SIZE,
    SUFFIXES,
    AutoEncoder,
    ContainerEncoder,
    Encoder,
    ZstdEncoder,
)
from ckptd.codec.frame import MAX_BLOCK, MIN_BLOCK
from ckptd.codec.index import TAIL_PROBE, Block, BlockIndex, decode_block, read_index
from ckptd.codec.planes import WIDTHS
from ckptd.errors import BadValue

# Every codec name `make_encoder` takes: the built-in ones, then those `register` adds (the
# config's `compress.codec` accepts the same list).
CODECS = model.CODECS
DEFAULT_LEVEL = 3
MAX_THREADS = 64

__all__ = [
    "BLOCK_SIZE",
    "CODECS",
    "DEFAULT_LEVEL",
    "TAIL_PROBE",
    "Block",
    "BlockIndex",
    "Encoder",
    "codec_suffix",
    "decode_block",
    "decode_stream",
    "make_encoder",
    "read_index",
    "read_threads",
    "register",
]


class MakeEncoder(Protocol):
    """Builds a registered codec's encoder writing to `out` (arguments as `make_encoder`'s)."""

    def __call__(self, out: BinaryIO, *, level: int, threads: int, min_saving: float,
                 width_hint: int | None, block_size: int) -> Encoder: ...


# The encoders of the codecs `register` added, by name (the built-in ones are `make_encoder`'s).
_REGISTERED: dict[str, MakeEncoder] = {}


def register(name: str, make: MakeEncoder, suffix: str) -> None:
    """Make codec `name` known, the one registration a codec name needs: a value a root's
    `compress.codec` may take (the config checks names in `CODECS`), what `make_encoder` builds
    with `make`, and the suffix its objects carry (`codec_suffix`). BadValue for a name
    already taken."""
    if name in CODECS:
        raise BadValue(f"codec {name!r} is already registered")
    _REGISTERED[name] = make
    SUFFIXES[name] = suffix
    CODECS.append(name)


def codec_suffix(codec: str) -> str:
    """The object-name suffix of a stored codec (`auto` resolves per file: see `Encoder`)."""
    if codec not in SUFFIXES:
        raise BadValue(f"no fixed suffix for codec {codec!r}")
    return SUFFIXES[codec]


def make_encoder(
    codec: str,
    out: BinaryIO,
    level: int = DEFAULT_LEVEL,
    threads: int = 1,
    min_saving: float = 0.03,
    width_hint: int | None = None,
    block_size: int = BLOCK_SIZE,
) -> Encoder:
    """A streaming encoder writing `codec` to `out`.

    `level` is the zstd level of plain-zstd data (codec `zstd`, and `auto` blocks that are not
    numeric); byte planes always use parameters tuned for them. `width_hint` (1, 2, 4 or 8
    bytes per element, e.g. from a tensor's dtype) skips width detection.
    """
    _check_args(codec, level, threads, min_saving, width_hint, block_size)
    if codec in _REGISTERED:
        return _REGISTERED[codec](out, level=level, threads=threads, min_saving=min_saving,
                                  width_hint=width_hint, block_size=block_size)
    coders = buffers.coders(level)
    if codec == "none":
        return Encoder("none", out)
    if codec == "zstd":
        return ZstdEncoder(out, coders, threads, block_size)
    widths = (width_hint,) if width_hint else (2, 4)
    policy = BlockPolicy(level, min_saving, widths, allow_plain=codec == "auto")
    if codec == "auto":
        return AutoEncoder(out, policy, coders, threads, block_size)
    return ContainerEncoder(out, policy, coders, threads, block_size)


def _check_args(
    codec: str,
    level: int,
    threads: int,
    min_saving: float,
    width_hint: int | None,
    block_size: int,
) -> None:
    if codec not in CODECS:
        raise BadValue(f"unknown codec {codec!r}; expected one of {', '.join(CODECS)}")
    if not -7 <= level <= 22:
        raise BadValue(f"zstd level {level} out of range -7..22")
    if not 1 <= threads <= MAX_THREADS:
        raise BadValue(f"threads {threads} out of range 1..{MAX_THREADS}")
    if not 0.0 <= min_saving < 1.0:
        raise BadValue(f"min_saving {min_saving} out of range [0, 1)")
    if width_hint is not None and width_hint not in WIDTHS:
        raise BadValue(f"width_hint {width_hint} not one of {WIDTHS}")
    if not MIN_BLOCK <= block_size <= MAX_BLOCK:
        raise BadValue(f"block_size {block_size} out of range {MIN_BLOCK}..{MAX_BLOCK}")
