"""The int8 layer of the inplace-requant problem, and small helpers its public and hidden tests share.

``Int8Layer`` keeps what an inference kernel reads: an int8 weight ``qweight`` [out, in]
and one float32 ``scale`` per output row; ``forward`` dequantizes and multiplies. A
captured CUDA graph (or any code that kept these tensors) reads exactly these buffers,
which is why an update must write into them rather than replace them.
"""
from __future__ import annotations

import torch


class Int8Layer:
    """y = x @ (qweight * scale[:, None]).T with qweight int8 [rows, cols] and scale float32 [rows]."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor):
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(f"qweight must be a 2-D int8 tensor, got {qweight.dtype} {shape_of(qweight)}")
        if scale.dtype != torch.float32 or tuple(scale.shape) != (qweight.shape[0],):
            raise ValueError(f"scale must be float32 [{qweight.shape[0]}], got {scale.dtype} {shape_of(scale)}")
        self.qweight = qweight
        self.scale = scale

    @classmethod
    def empty(cls, rows: int, cols: int, device="cpu") -> "Int8Layer":
        """A layer of zeros (scale 1), the way an engine allocates buffers before loading."""
        return cls(torch.zeros(rows, cols, dtype=torch.int8, device=device),
                   torch.ones(rows, dtype=torch.float32, device=device))

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.dequantize().T

    __call__ = forward


def shape_of(t) -> str:
    """A shape the way the messages write it: [8, 16]."""
    return "[" + ", ".join(str(n) for n in tuple(t.shape)) + "]"


def storage_of(t: torch.Tensor) -> tuple:
    """What a kernel or captured graph depends on: address, shape, dtype, device."""
    return t.data_ptr(), tuple(t.shape), t.dtype, t.device


def what_moved(before: tuple, t: torch.Tensor) -> str:
    """The difference between a storage_of() record and a tensor now, in words."""
    names = ("address", "shape", "dtype", "device")
    now = storage_of(t)
    show = lambda name, v: hex(v) if name == "address" else str(list(v) if name == "shape" else v)  # noqa: E731
    return "; ".join(f"{n} {show(n, a)} became {show(n, b)}" for n, a, b in zip(names, before, now) if a != b) \
        or "nothing moved"


def expect_value_error(expectation: str, fn, *args) -> None:
    """Call fn(*args); unless it raises ValueError, fail with ``expectation`` in words."""
    try:
        fn(*args)
    except ValueError:
        return
    except Exception as e:  # noqa: BLE001 - any other outcome is the failure being described
        raise AssertionError(f"{expectation}, got {type(e).__name__}: {e}") from None
    raise AssertionError(f"{expectation}, but the call returned normally")
