"""Serialize weight payloads the way SGLang clients do, and unpickle them only through an allowlist.

Weight updates arrive as pickles (torch's multiprocessing reductions: CUDA IPC handles on
GPU, shared-memory file names on CPU), base64-encoded in HTTP bodies. A pickle can name
any callable and run it, so ``loads`` resolves only the globals listed here: containers,
torch's tensor/storage rebuilders, dtypes and ``torch.Size``, numpy's array rebuilders,
and the bucket metadata class (SGLang's module path maps to ours). Anything else raises
``UnsafePickleError`` naming the global, before any of it runs.
"""
from __future__ import annotations

import base64
import binascii
import codecs
import collections
import io
import os
import pickle
import re
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp
import torch.multiprocessing.reductions as reductions

from course_lib import settings
from course_lib.weights.transports.bucket import FlattenedTensorMetadata


class UnsafePickleError(ValueError):
    """The payload names a global outside the allowlist, asks for something no honest sender
    would (a direct constructor call, a view past its storage, a meta tensor), or is not a
    pickle at all."""


# The most bytes one storage in a payload may declare (COURSE_LIB_MAX_STORAGE_BYTES overrides;
# read once, at import).
MAX_STORAGE_BYTES = settings.max_storage_bytes()
DEVICES = ("cpu", "cuda")
_SHM_HANDLE = re.compile(r"/torch_\d+_\d+_\d+")  # the names torch's file_system strategy gives segments


class ClassRef:
    """A class a payload may name as an argument (``rebuild_tensor``'s ``torch.Tensor``) but
    never call: ``UntypedStorage(2_000_000_000)``, ``Tensor(n)`` or ``ndarray(shape)`` would
    allocate from a number in a 40-byte pickle. Immutable, and NEWOBJ refuses it (not a type)."""
    __slots__ = ("cls",)

    def __init__(self, cls):
        object.__setattr__(self, "cls", cls)

    def __setattr__(self, name, value):
        raise UnsafePickleError("payload tries to modify a class reference")

    def __call__(self, *args, **kwargs):
        raise UnsafePickleError(f"payload calls {self.cls.__module__}.{self.cls.__qualname__} directly; "
                                f"only torch's and numpy's rebuild functions may construct tensors")


def _cls(ref, *allowed):
    if not (isinstance(ref, ClassRef) and ref.cls in allowed):
        raise UnsafePickleError(f"payload passes {ref!r} where one of {[c.__name__ for c in allowed]} belongs")
    return ref.cls


def _int(value, what: str, low: int = 0, high: int = 1 << 62) -> int:
    if type(value) is not int or not low <= value <= high:
        raise UnsafePickleError(f"payload's {what} {value!r} is not an integer in [{low}, {high}]")
    return value


def _storage_parts(storage) -> tuple[torch.UntypedStorage, torch.dtype]:
    """The bytes and dtype torch's rebuilders will use, checked (device, type)."""
    if isinstance(storage, torch.UntypedStorage):
        untyped, dtype = storage, torch.uint8
    elif type(storage) is torch.storage.TypedStorage:
        untyped, dtype = storage.__dict__.get("_untyped_storage"), storage.__dict__.get("dtype")
    else:
        raise UnsafePickleError(f"payload's tensor storage is a {type(storage).__name__}, not a torch storage")
    if not isinstance(untyped, torch.UntypedStorage) or not isinstance(dtype, torch.dtype):
        raise UnsafePickleError("payload's typed storage was tampered with")
    if untyped.device.type not in DEVICES:
        raise UnsafePickleError(f"payload's storage is on device {untyped.device.type!r}; only {DEVICES} are accepted")
    return untyped, dtype


def check_view(storage, offset, size, stride) -> None:
    """Refuse a view that would reach past its storage (torch would grow the storage and
    expose bytes nobody sent) or has negative or absurd sizes, strides or offsets."""
    untyped, dtype = _storage_parts(storage)
    offset = _int(offset, "storage offset")
    if not isinstance(size, (tuple, list)) or not isinstance(stride, (tuple, list)) or len(size) != len(stride) \
            or len(size) > 64:
        raise UnsafePickleError(f"payload's tensor size {size!r} and stride {stride!r} do not match")
    sizes = [_int(n, "tensor size") for n in size]
    strides = [_int(n, "tensor stride") for n in stride]
    extent = 0 if 0 in sizes else offset + 1 + sum((n - 1) * st for n, st in zip(sizes, strides))
    have = untyped.nbytes() // dtype.itemsize
    if extent > have:
        raise UnsafePickleError(f"payload's tensor of size {tuple(sizes)} (stride {tuple(strides)}, offset {offset}) "
                                f"needs {extent} elements; its storage holds {have}")


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    check_view(storage, storage_offset, size, stride)
    if backward_hooks or metadata:
        raise UnsafePickleError("payload's tensor carries hooks or metadata")
    return torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, bool(requires_grad),
                                           collections.OrderedDict())


def _rebuild_parameter(data, requires_grad, backward_hooks):
    if not isinstance(data, torch.Tensor) or backward_hooks:
        raise UnsafePickleError("payload's parameter is not a plain tensor")
    return torch._utils._rebuild_parameter(data, bool(requires_grad), collections.OrderedDict())


def _rebuild_tensor(cls, storage, metadata):
    _cls(cls, torch.Tensor)
    offset, size, stride, requires_grad = metadata
    check_view(storage, offset, size, stride)
    return reductions.rebuild_tensor(torch.Tensor, storage, (offset, size, stride, bool(requires_grad)))


def _rebuild_cuda_tensor(tensor_cls, tensor_size, tensor_stride, tensor_offset, storage_cls, dtype, storage_device,
                         storage_handle, storage_size_bytes, *rest):
    _cls(tensor_cls, torch.Tensor)
    storage_cls = _cls(storage_cls, torch.UntypedStorage, torch.storage.TypedStorage)
    if not isinstance(dtype, torch.dtype):
        raise UnsafePickleError(f"payload's CUDA tensor has dtype {dtype!r}")
    nbytes = _int(storage_size_bytes, "CUDA storage size", high=MAX_STORAGE_BYTES)
    sizes = [_int(n, "tensor size") for n in tensor_size]
    strides = [_int(n, "tensor stride") for n in tensor_stride]
    offset = _int(tensor_offset, "storage offset")
    if len(sizes) != len(strides):
        raise UnsafePickleError("payload's CUDA tensor size and stride do not match")
    extent = 0 if 0 in sizes else offset + 1 + sum((n - 1) * st for n, st in zip(sizes, strides))
    if extent * dtype.itemsize > nbytes:
        raise UnsafePickleError(f"payload's CUDA tensor of size {tuple(sizes)} needs {extent * dtype.itemsize} bytes; "
                                f"its storage holds {nbytes}")
    return reductions.rebuild_cuda_tensor(torch.Tensor, tensor_size, tensor_stride, tensor_offset, storage_cls, dtype,
                                          storage_device, storage_handle, storage_size_bytes, *rest)


def _rebuild_typed_storage(storage, dtype):
    if not isinstance(storage, torch.UntypedStorage) or not isinstance(dtype, torch.dtype):
        raise UnsafePickleError("payload's typed storage does not wrap an untyped storage")
    _storage_parts(storage)
    return reductions.rebuild_typed_storage(storage, dtype)


def _rebuild_typed_storage_child(storage, storage_type):
    _cls(storage_type, torch.storage.TypedStorage)
    return _rebuild_typed_storage(storage, storage.dtype) if isinstance(storage, torch.UntypedStorage) else \
        _rebuild_typed_storage(storage, None)


def _rebuild_storage_filename(cls, manager, handle, size, dtype=None):
    """A CPU shared-memory segment by name. Only torch's own segment names, and never
    larger than the segment already is (mapping a larger size would grow someone's file)."""
    cls = _cls(cls, torch.UntypedStorage, torch.storage.TypedStorage)
    if not isinstance(handle, (str, bytes)) or not _SHM_HANDLE.fullmatch(os.fsdecode(handle)):
        raise UnsafePickleError(f"payload's shared-memory handle {handle!r} is not a torch shared-memory segment")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise UnsafePickleError(f"payload's storage dtype {dtype!r} is not a torch dtype")
    nbytes = _int(size, "shared storage size", high=MAX_STORAGE_BYTES) * (dtype.itemsize if dtype else 1)
    try:
        have = os.stat("/dev/shm" + os.fsdecode(handle)).st_size
    except OSError as exc:
        raise UnsafePickleError(f"payload's shared-memory handle {handle!r} cannot be opened ({exc})") from None
    if nbytes > have:
        raise UnsafePickleError(f"payload's shared storage declares {nbytes} bytes; the segment holds {have}")
    return reductions.rebuild_storage_filename(cls, manager, handle, size, dtype)


def _rebuild_storage_empty(cls):
    return _cls(cls, torch.UntypedStorage, torch.storage.TypedStorage)()


def _bytes(kind):
    def build(*args):
        if args and isinstance(args[0], int):  # bytes(n) / bytearray(n): n zero bytes from one number
            raise UnsafePickleError(f"payload calls {kind.__name__}({args[0]!r}): sized allocations are not allowed")
        return kind(*args)
    return build


def _encode(obj, encoding="utf-8", errors="strict"):
    if not isinstance(obj, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise UnsafePickleError(f"payload encodes with {encoding!r}; only latin1 (pickle's bytes) is allowed")
    return codecs.encode(obj, encoding, errors)


def _np_reconstruct(subtype, shape, dtype):
    import numpy as np
    _cls(subtype, np.ndarray)
    if tuple(shape) != (0,):  # numpy pickles an empty array, then fills it from the state's bytes
        raise UnsafePickleError(f"payload asks numpy for an array of shape {shape!r} before sending its data")
    return np.ndarray.__new__(np.ndarray, (0,), dtype)


def _load_storage_bytes(b: bytes):
    """A storage pickled by value (torch's legacy ``torch.save`` format). torch's own
    ``_load_from_bytes`` runs an unchecked ``torch.load`` and allocates what the header
    declares before reading the data; here the header must describe exactly one storage
    whose declared size fits in the bytes actually sent."""
    f = io.BytesIO(b)
    pids: list = []
    try:
        for _ in range(3):  # magic number, protocol version, system info: plain values
            _HeaderUnpickler(f, pids).load()
        root = _HeaderUnpickler(f, pids).load()
        _HeaderUnpickler(f, pids).load()  # the storage keys
    except UnsafePickleError:
        raise
    except Exception as exc:
        raise UnsafePickleError(f"payload's by-value storage is malformed ({type(exc).__name__}: {exc})") from None
    if len(pids) != 1 or root is not pids[0] or len(pids[0]) < 5 or pids[0][0] != "storage":
        raise UnsafePickleError("payload's by-value storage must hold exactly one storage")
    _, storage_type, _key, location, numel = pids[0][:5]
    dtype = storage_type.cls.dtype if issubclass(storage_type.cls, torch.storage.TypedStorage) else torch.uint8
    nbytes = _int(numel, "by-value storage size") * dtype.itemsize
    if nbytes > len(b) - f.tell() or not isinstance(location, str) or location.split(":")[0] not in DEVICES:
        raise UnsafePickleError(f"payload's by-value storage declares {nbytes} bytes on {location!r}; "
                                f"it carries {len(b) - f.tell()}")
    # Then the storage's element count (int64) and its bytes. Built here rather than by
    # torch.load, which cannot even read back an untyped storage in this format.
    count = int.from_bytes(f.read(8), "little", signed=True)
    data = f.read(nbytes)
    if count != numel or len(data) != nbytes:
        raise UnsafePickleError(f"payload's by-value storage declares {numel} elements but carries {len(data)} bytes")
    untyped = torch.frombuffer(bytearray(data), dtype=torch.uint8).untyped_storage() if nbytes else torch.UntypedStorage()
    if location != "cpu":
        untyped = untyped.cuda(location)
    if dtype is torch.uint8 and not issubclass(storage_type.cls, torch.storage.TypedStorage):
        return untyped
    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


class _HeaderUnpickler(pickle.Unpickler):
    """Reads a legacy storage header: plain values, and storage classes only as references."""

    def __init__(self, f, pids: list):
        super().__init__(f)
        self.pids = pids

    def find_class(self, module: str, name: str):
        cls = getattr(torch, name, None) if module in ("torch", "torch.storage") else None
        if isinstance(cls, type) and issubclass(cls, (torch.UntypedStorage, torch.storage.TypedStorage)):
            return ClassRef(cls)
        raise UnsafePickleError(f"payload's by-value storage refers to {module}.{name}")

    def persistent_load(self, pid):
        if not isinstance(pid, tuple) or len(pid) < 5 or not isinstance(pid[1], ClassRef):
            raise UnsafePickleError("payload's by-value storage has a malformed storage record")
        self.pids.append(pid)
        return pid


_ALLOWED = {
    "builtins": {"list", "dict", "tuple", "set", "frozenset", "int", "float", "str", "bool", "complex", "slice"},
    "collections": {"OrderedDict"},
    "torch": {"Size"},
    "numpy": {"dtype"},
    "numpy.core.multiarray": {"scalar"},
    "numpy._core.multiarray": {"scalar"},
}
_CLASSES = {  # named as arguments only (see ClassRef)
    ("torch", "Tensor"): lambda: torch.Tensor,
    ("torch.storage", "UntypedStorage"): lambda: torch.UntypedStorage,
    ("torch", "UntypedStorage"): lambda: torch.UntypedStorage,
    ("torch.storage", "TypedStorage"): lambda: torch.storage.TypedStorage,
    ("numpy", "ndarray"): lambda: __import__("numpy").ndarray,
}
_REPLACED = {  # checked stand-ins for the functions a payload may call
    ("torch.storage", "_load_from_bytes"): _load_storage_bytes,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch.multiprocessing.reductions", "rebuild_tensor"): _rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): _rebuild_typed_storage,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage_child"): _rebuild_typed_storage_child,
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"): _rebuild_storage_filename,
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"): _rebuild_storage_empty,
    ("builtins", "bytes"): _bytes(bytes),
    ("builtins", "bytearray"): _bytes(bytearray),
    ("_codecs", "encode"): _encode,  # how protocol 2 spells bytes
    ("numpy.core.multiarray", "_reconstruct"): _np_reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _np_reconstruct,
    ("course_lib.weights.transports.bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
}


def _refuse_state(state):
    raise UnsafePickleError("payload sets a tensor's state after building it (torch would set_() it to any "
                            "size); tensors must come whole from their rebuild function")


class SafeUnpickler(pickle.Unpickler):
    """The allowlisted unpickler. Every tensor it builds refuses a later BUILD opcode while
    the load runs (an instance ``__setstate__``, removed when the load ends)."""

    def __init__(self, f):
        super().__init__(f)
        self.tensors: list[torch.Tensor] = []

    def find_class(self, module: str, name: str):
        if (module, name) in _REPLACED:
            fn = _REPLACED[(module, name)]
            return fn if isinstance(fn, type) else self._guarded(fn)
        if (module, name) in _CLASSES:
            return ClassRef(_CLASSES[(module, name)]())
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise UnsafePickleError(f"payload refers to {module}.{name}, which is not allowed "
                                f"(only tensors, numpy arrays, bucket metadata and plain containers)")

    def _guarded(self, fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                out.__setstate__ = _refuse_state
                self.tensors.append(out)
            return out
        return call

    def load(self):
        try:
            return super().load()
        finally:
            for t in self.tensors:
                t.__dict__.pop("__setstate__", None)


def dumps(obj) -> bytes:
    """Pickle with torch's multiprocessing reductions: tensors travel as handles to shared
    memory (CPU) or CUDA IPC handles (GPU), not as copies of their bytes."""
    if mp.get_sharing_strategy() != "file_system":
        # Handles must survive a trip through bytes (HTTP): file names, not file descriptors.
        mp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf, 2).dump(obj)
    return buf.getvalue()


def loads(data: bytes):
    try:
        return SafeUnpickler(io.BytesIO(data)).load()
    except UnsafePickleError:
        raise
    except pickle.UnpicklingError as exc:
        if "ClassRef" in str(exc):  # NEWOBJ / NEWOBJ_EX on a class the payload may only name
            raise UnsafePickleError("payload constructs a tensor, storage or array class directly; only torch's "
                                    "and numpy's rebuild functions may") from None
        raise UnsafePickleError(f"payload is not a valid pickle ({exc})") from exc
    except Exception as exc:
        raise UnsafePickleError(f"payload is not a valid pickle ({type(exc).__name__}: {exc})") from exc


def serialize(obj) -> str:
    """Base64 text, as SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)``."""
    return base64.b64encode(dumps(obj)).decode("ascii")


def deserialize(data: str | bytes):
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise UnsafePickleError(f"payload is not base64 ({exc})") from exc
    return loads(data)
