"""Decides whether a pickle (a torch archive's data.pkl, a legacy torch file) is safe to load, by
walking its opcodes with `pickletools` and tracking what each call would call.

Never unpickles and never imports what a pickle names: references outside an allow-list equal to
what `torch.load(weights_only=True)` accepts (plus plain numpy data) make it `unsafe_pickle`.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from collections.abc import Iterable
from dataclasses import dataclass
from typing import BinaryIO

from ckptd.errors import Malformed, Signal, ValidationFailed
from ckptd.model import Reason


def _names(module: str, names: Iterable[str], suffix: str = "") -> set[str]:
    return {f"{module}.{n}{suffix}" for n in names}


_DTYPES = (
    (
        "bfloat16 bits16 bits1x8 bits2x4 bits4x2 bits8 bool complex128 complex32 complex64 float16"
        " float32 float4_e2m1fn_x2 float64 float8_e4m3fn float8_e4m3fnuz float8_e5m2"
        " float8_e5m2fnuz float8_e8m0fnu int8 int16 int32 int64 qint32 qint8 quint2x4 quint4x2"
        " quint8 uint8 uint16 uint32 uint64"
    ).split()
    + [f"int{i}" for i in range(1, 8)]
    + [f"uint{i}" for i in range(1, 8)]
)
_DENSE = "BFloat16 Bool Byte Char Double Float Half Int Long Short".split()
_SPARSE = [t for t in _DENSE if t != "Bool"]
_STORAGE = _DENSE + ["ComplexDouble", "ComplexFloat"]
_QSTORAGE = "QInt32 QInt8 QUInt2x4 QUInt4x2 QUInt8".split()
_QSCHEMES = (
    "per_tensor_affine per_tensor_symmetric per_channel_affine per_channel_symmetric"
    " per_channel_affine_float_qparams"
).split()
_REBUILD = (
    "_rebuild_parameter _rebuild_parameter_with_state _rebuild_qtensor _rebuild_tensor"
    " _rebuild_tensor_v2 _rebuild_tensor_v3 _rebuild_sparse_tensor"
    " _rebuild_meta_tensor_no_storage _rebuild_nested_tensor _rebuild_wrapper_subclass"
    " _rebuild_device_tensor_from_numpy _rebuild_device_tensor_from_cpu_tensor"
).split()

# What torch.load(weights_only=True) allows by default (torch/_weights_only_unpickler.py,
# `_get_allowed_globals`); a test keeps this equal to the installed torch's list.
TORCH_SAFE_GLOBALS: frozenset[str] = frozenset(
    {
        "collections.OrderedDict",
        "collections.Counter",
        "torch.nn.parameter.Parameter",
        "torch.serialization._get_layout",
        "torch.Size",
        "torch.Tensor",
        "torch.device",
        "_codecs.encode",
        "builtins.bytearray",
        "builtins.set",
        "builtins.complex",
        "torch._tensor._rebuild_from_type_v2",
        "torch.storage.TypedStorage",
        "torch.storage.UntypedStorage",
    }
    | _names("torch", _DTYPES + _QSCHEMES)
    | _names("torch", _DENSE, "Tensor")
    | _names("torch.cuda", _DENSE, "Tensor")
    | _names("torch.sparse", _SPARSE, "Tensor")
    | _names("torch.cuda.sparse", _SPARSE, "Tensor")
    | _names("torch", _STORAGE + _QSTORAGE, "Storage")
    | _names("torch.cuda", _STORAGE, "Storage")
    | _names("torch._utils", _REBUILD)
)

# Plain data beyond torch's default list: numpy arrays/scalars/dtypes (HF Trainer's
# rng_state.pth, metrics saved as numpy scalars) and two harmless builtins. None of these runs
# code named by the pickle; an object array's items are pickled inline and scanned like the rest.
EXTRA_SAFE_GLOBALS: frozenset[str] = frozenset(
    {
        "builtins.frozenset",
        "builtins.slice",
        "numpy.ndarray",
        "numpy.dtype",
        "numpy.core.multiarray._reconstruct",
        "numpy.core.multiarray.scalar",
        "numpy._core.multiarray._reconstruct",
        "numpy._core.multiarray.scalar",
    }
)

SAFE_GLOBALS: frozenset[str] = TORCH_SAFE_GLOBALS | EXTRA_SAFE_GLOBALS

# torch's legacy (pre-zip) format starts with a pickle of this number.
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PICKLES = 5  # magic, protocol version, sys info, the object, storage keys
_PY2_STRINGS = {"STRING", "BINSTRING", "SHORT_BINSTRING"}
_STRINGS = {"UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"} | _PY2_STRINGS
# Opcodes that call something on the stack: the callee must be an allowed global.
_CALLS = {"REDUCE": 2, "NEWOBJ": 2, "NEWOBJ_EX": 3}


class _Mark:
    """The MARK opcode's entry on the simulated stack."""


_MARK = _Mark()
_UNKNOWN = object()  # any value whose identity does not matter to safety


@dataclass(frozen=True)
class _Global:
    name: str


class _Unsafe(Signal):
    """An opcode does what no safe checkpoint pickle does. Raised from the opcode handlers
    (several calls deep in `_Machine.step`); an exception, not a return value, so each handler
    stays a plain statement. `scan_pickle` turns it into its ValidationFailed with the
    machine's verdict."""


def canonical_global(module: str, name: str) -> str:
    """`module.name` with Python 2 names (written by protocol 0-2 pickles) mapped to Python 3."""
    if (module, name) in NAME_MAPPING:
        module, name = NAME_MAPPING[(module, name)]
    elif module in IMPORT_MAPPING:
        module = IMPORT_MAPPING[module]
    return f"{module}.{name}"


# What the scan keeps is bounded whatever the pickle: a real checkpoint's pickle memoizes one
# entry per object (tens of thousands for a large model); past these it is a bomb.
MAX_MEMO = 1_000_000
MAX_STACK = 1_000_000


class _Machine:
    """A stack machine over opcodes that keeps only what safety depends on: which values are
    globals (and which), which are strings (STACK_GLOBAL's operands), and the memo."""

    def __init__(self, allowed: frozenset[str] | None) -> None:
        self.allowed = allowed
        self.stack: list[object] = []
        self.memo: dict[int, object] = {}
        self.globals: set[str] = set()
        self.untrusted: list[str] = []

    def step(self, op: pickletools.OpcodeInfo, arg: object) -> None:
        if len(self.stack) > MAX_STACK:
            raise Malformed(f"stack over {MAX_STACK} items (a memory bomb, not a checkpoint)")
        handler = _HANDLERS.get(op.name)
        if handler is not None:
            handler(self, arg)
        elif op.name in _CALLS:
            self._call(op.name, _CALLS[op.name])
        elif op.name in _STRINGS:
            self.stack.append(arg if isinstance(arg, str) else _UNKNOWN)
        elif op.name.startswith("EXT"):
            raise _Unsafe(f"{op.name} loads a global through the extension registry")
        else:
            self._generic(op)

    def _generic(self, op: pickletools.OpcodeInfo) -> None:
        effect = _EFFECTS.get(op.name)
        if effect is None:
            before = op.stack_before
            mark = pickletools.markobject in before
            if mark:
                before = before[: before.index(pickletools.markobject)]
            effect = _EFFECTS[op.name] = (mark, len(before), len(op.stack_after))
        mark, pops, pushes = effect
        if mark:
            self._pop_mark()
        if pops:
            self._pop(pops)
        self.stack.extend([_UNKNOWN] * pushes)

    def _pop(self, n: int) -> list[object]:
        if n > len(self.stack) or any(v is _MARK for v in self.stack[len(self.stack) - n :]):
            raise Malformed("stack underflow")
        items = self.stack[len(self.stack) - n :]
        del self.stack[len(self.stack) - n :]
        return items

    def _pop_mark(self) -> list[object]:
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i] is _MARK:
                items = self.stack[i + 1 :]
                del self.stack[i:]
                return items
        raise Malformed("no MARK on the stack")

    def _check(self, full: str) -> _Global:
        # An untrusted global is noted and the walk goes on, so that one message can name every
        # global a file needs trusted, not only the first.
        self.globals.add(full)
        if self.allowed is not None and full not in self.allowed and full not in self.untrusted:
            self.untrusted.append(full)
        return _Global(full)

    def verdict(self, unsafe: str = "") -> str:
        """Why the pickle is unsafe ("" when it is not): every untrusted global it names, in
        the order met, then the first unsafe construct (`unsafe`), if any."""
        parts = []
        if self.untrusted:
            names = ", ".join(self.untrusted)
            which = "which is" if len(self.untrusted) == 1 else "which are"
            parts.append(f"references {names}, {which} not on the allow-list")
        if unsafe:
            parts.append(unsafe)
        return "; ".join(parts)

    def _callee(self, value: object, how: str) -> None:
        if not isinstance(value, _Global):
            raise _Unsafe(f"{how} on a value that is not a global")

    def _call(self, name: str, arity: int) -> None:
        items = self._pop(arity)
        self._callee(items[0], name)
        self.stack.append(_UNKNOWN)

    def _op_MARK(self, arg: object) -> None:
        self.stack.append(_MARK)

    def _op_GLOBAL(self, arg: object) -> None:
        module, _, name = str(arg).partition(" ")
        self.stack.append(self._check(canonical_global(module, name)))

    def _op_STACK_GLOBAL(self, arg: object) -> None:
        module, name = self._pop(2)
        if not (isinstance(module, str) and isinstance(name, str)):
            raise _Unsafe("STACK_GLOBAL with a name that is not a plain string")
        self.stack.append(self._check(canonical_global(module, name)))

    def _op_INST(self, arg: object) -> None:
        module, _, name = str(arg).partition(" ")
        self._check(canonical_global(module, name))
        self._pop_mark()
        self.stack.append(_UNKNOWN)

    def _op_OBJ(self, arg: object) -> None:
        items = self._pop_mark()
        if not items:
            raise Malformed("OBJ without a class")
        self._callee(items[0], "OBJ")
        self.stack.append(_UNKNOWN)

    def _op_BUILD(self, arg: object) -> None:
        self._pop(1)
        if not self.stack or isinstance(self.stack[-1], _Global):
            # Setting state on a class or function would rewrite it in the loading process.
            raise _Unsafe("BUILD on a global rather than on an object")
        self.stack[-1] = _UNKNOWN

    def _op_DUP(self, arg: object) -> None:
        self.stack.append(self._pop(1)[0])
        self.stack.append(self.stack[-1])

    def _op_POP_MARK(self, arg: object) -> None:
        self._pop_mark()

    def _put(self, index: object) -> None:
        if not self.stack or not isinstance(index, int):
            raise Malformed("memo store with an empty stack")
        if not 0 <= index < MAX_MEMO:
            # Python's own unpickler sizes its memo by the largest index: 11 bytes naming
            # index 10^8 cost it 1.5 GiB. A real pickle numbers its memo from 0.
            raise Malformed(f"memo index {index} (a memory bomb, not a checkpoint)")
        if len(self.memo) >= MAX_MEMO and index not in self.memo:
            raise Malformed(f"memo over {MAX_MEMO} entries (a memory bomb, not a checkpoint)")
        self.memo[index] = self.stack[-1]

    def _get(self, index: object) -> None:
        if not isinstance(index, int) or index not in self.memo:
            raise Malformed(f"memo key {index!r} was never stored")
        self.stack.append(self.memo[index])

    def _op_MEMOIZE(self, arg: object) -> None:
        self._put(len(self.memo))

    _op_PUT = _op_BINPUT = _op_LONG_BINPUT = _put
    _op_GET = _op_BINGET = _op_LONG_BINGET = _get


# Each opcode's handler and each other opcode's stack effect (MARK popped first, items
# popped, items pushed), looked up by name once per opcode rather than built per step.
_HANDLERS = {name.removeprefix("_op_"): fn for name, fn in vars(_Machine).items()
             if name.startswith("_op_")}
_EFFECTS: dict[str, tuple[bool, int, int]] = {}


def scan_pickle(
    source: bytes | BinaryIO, what: str = "pickle",
    allowed: frozenset[str] | None = SAFE_GLOBALS,
) -> frozenset[str]:
    """Check one pickle (up to its STOP); return the globals it references. `allowed=None`
    checks only its structure (for reading it with inert stand-ins, where no global runs).

    Raises ValidationFailed: `unsafe_pickle` when it references globals outside `allowed` (the
    message names every one), calls anything but a global, sets state on a global, or uses the
    extension registry; `bad_header` when its opcodes do not parse. A file object is left just
    after the pickle's STOP.
    """
    machine = _Machine(allowed)
    if not isinstance(source, bytes | bytearray | memoryview):
        source = _Bounded(source)  # type: ignore[assignment]
    try:
        for op, arg, _pos in pickletools.genops(source):
            machine.step(op, arg)
    except _Unsafe as exc:
        raise ValidationFailed(Reason.UNSAFE_PICKLE, f"{what} {machine.verdict(str(exc))}",
                               what) from None
    except (ValueError, IndexError, KeyError, EOFError, UnicodeDecodeError, OverflowError,
            MemoryError) as exc:
        raise ValidationFailed(
            Reason.BAD_HEADER, f"{what} is not a valid pickle: {exc}", what
        ) from None
    if machine.untrusted:
        raise ValidationFailed(Reason.UNSAFE_PICKLE, f"{what} {machine.verdict()}", what)
    return frozenset(machine.globals)


class _Bounded(io.RawIOBase):
    """A file whose reads never ask for more than what is left in it: an opcode that declares
    a 4 GiB string in a small file gets a short read (not a pickle), not a 4 GiB buffer."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        here = f.tell()
        self._end = f.seek(0, io.SEEK_END)
        f.seek(here)

    def read(self, n: int | None = -1) -> bytes:
        left = max(0, self._end - self._f.tell())
        return self._f.read(left if n is None or n < 0 else min(n, left))

    def readline(self, limit: int | None = -1) -> bytes:
        return self._f.readline(_LINE_MAX if limit is None or limit < 0 else limit)

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True


_LINE_MAX = 1 << 20  # a protocol 0 argument line (a GLOBAL name, a number) is short


def scan_torch_pickle_file(f: BinaryIO, what: str, allowed: frozenset[str] = SAFE_GLOBALS
                           ) -> frozenset[str]:
    """Check a non-zip torch file (torch's legacy format: five pickles, then raw storages) or
    a plain pickle file. Reads only the pickles, leaving the storage bytes alone. Every pickle
    torch's legacy loader would unpickle is scanned: when the first is (or may be) the magic
    number, so are the four after it."""
    start = f.tell()
    found = set(scan_pickle(f, what, allowed))
    legacy = _is_legacy_magic(f, start)
    if legacy is False:
        return frozenset(found)
    for _ in range(_LEGACY_PICKLES - 1):
        if legacy is None and not f.read(1):
            break  # a plain pickle file after all
        if legacy is None:
            f.seek(-1, io.SEEK_CUR)
        try:
            found |= scan_pickle(f, what, allowed)
        except ValidationFailed as exc:
            if legacy is None and exc.reason == Reason.BAD_HEADER:
                break  # raw bytes follow: not a legacy file, and no loader runs them
            raise
    return frozenset(found)


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        raise pickle.UnpicklingError("globals are not allowed here")


# torch's legacy loader unpickles the first pickle whatever its size and compares it with the
# magic number: padding may push the number anywhere. Past this size it is not loaded here
# (memory), and the pickles after it are scanned as if it were the magic.
_MAGIC_PICKLE_MAX = 1024 * 1024


def _is_legacy_magic(f: BinaryIO, start: int) -> bool | None:
    """Is the pickle that just ended the legacy magic number? None: too big to tell."""
    end = f.tell()
    if end - start > _MAGIC_PICKLE_MAX:
        return None
    f.seek(start)
    head = f.read(end - start)
    f.seek(end)
    try:
        return bool(_NoGlobals(io.BytesIO(head)).load() == LEGACY_MAGIC)
    except Exception:  # broad: untrusted bytes use a global, so cannot tell; scan what follows
        return None
