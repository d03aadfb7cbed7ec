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
import io
import pickle
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp

from course_lib.weights.bucket import FlattenedTensorMetadata


class UnsafePickleError(ValueError):
    """The payload names a global outside the allowlist (or is not a pickle at all)."""


def _load_storage_bytes(b: bytes):
    # torch's own _load_from_bytes calls torch.load(weights_only=False): a second, unchecked
    # unpickler. Storages pickled by value are loaded with weights_only=True instead.
    return torch.load(io.BytesIO(b), weights_only=True)


_ALLOWED = {
    "builtins": {"list", "dict", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "bytearray",
                 "bool", "complex", "slice"},
    "collections": {"OrderedDict"},
    "_codecs": {"encode"},  # how protocol 2 spells bytes
    "torch": {"Size", "Tensor"},
    "torch.storage": {"UntypedStorage", "TypedStorage"},
    "torch._utils": {"_rebuild_tensor_v2", "_rebuild_parameter"},
    "torch.multiprocessing.reductions": {"rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage",
                                         "rebuild_typed_storage_child", "rebuild_storage_filename",
                                         "rebuild_storage_empty"},
    "numpy": {"ndarray", "dtype"},
    "numpy.core.multiarray": {"_reconstruct", "scalar"},
    "numpy._core.multiarray": {"_reconstruct", "scalar"},
}
_REPLACED = {
    ("torch.storage", "_load_from_bytes"): _load_storage_bytes,
    ("course_lib.weights.bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
}


class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _REPLACED:
            return _REPLACED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise UnsafePickleError(f"payload refers to {module}.{name}, which is not allowed "
                                f"(only tensors, numpy arrays, bucket metadata and plain containers)")


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
