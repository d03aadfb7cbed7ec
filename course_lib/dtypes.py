"""Dtype names, parsed in one place.

Payloads, config files and HTTP bodies name dtypes as text: ``"bfloat16"`` (SGLang's and
Hugging Face's spelling) or ``"torch.bfloat16"`` (``str(torch.bfloat16)``). Every reader
of such a name calls ``parse_dtype``, so all of them accept the same spellings and refuse
the same things: only an attribute of ``torch`` that really is a ``torch.dtype`` is
accepted, never just any attribute (``"Tensor"``, ``"nn"``, ``"_C"``), and a refusal is a
``DtypeError`` naming the bad value (and, where the caller restricts the choice, the
allowed names). Callers that promise their own error type (``ConfigError``,
``SparsePayloadError``, ...) catch ``DtypeError`` and raise theirs.

- ``parse_dtype(value, allowed=None)``: one ``torch.dtype`` from a dtype or its name;
- ``parse_dtypes(values)``: a list of them, the error naming the position;
- ``dtype_name(dtype)``: the name payloads carry (``"bfloat16"``);
- ``SAFETENSORS_DTYPES`` / ``parse_safetensors_dtype(code)``: safetensors' own codes
  (``"BF16"``), the ones this project reads.
"""
from __future__ import annotations

import torch

# The codes a safetensors header may use that this project reads (safetensors_format.py).
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn}


class DtypeError(ValueError):
    """A value that is not a torch dtype (or not one of those allowed); the message names it."""


def _lookup(value) -> torch.dtype | None:
    if isinstance(value, torch.dtype):
        return value
    if not isinstance(value, str):
        return None
    # getattr on the module: "float" and "half" are torch's own aliases and are accepted;
    # anything that is not a dtype ("Tensor", "nn", "_C") is refused by the isinstance below.
    found = getattr(torch, value.removeprefix("torch."), None)
    return found if isinstance(found, torch.dtype) else None


def dtype_name(dtype) -> str:
    """The name a payload carries: ``"bfloat16"`` for ``torch.bfloat16`` (or for any spelling
    ``parse_dtype`` accepts; an alias gives the canonical name: ``"half"`` -> ``"float16"``)."""
    return str(parse_dtype(dtype)).removeprefix("torch.")


def parse_dtype(value, allowed=None) -> torch.dtype:
    """The ``torch.dtype`` that ``value`` is or names (``"bfloat16"`` or ``"torch.bfloat16"``).

    ``allowed``, when given, is the dtypes (or names) the caller accepts; any other dtype
    is refused too. Raises ``DtypeError`` naming ``value`` (and the allowed names)."""
    dtype = _lookup(value)
    if dtype is None:
        raise DtypeError(f"dtype {value!r} is not a torch dtype" + _choices(allowed))
    if allowed is not None and dtype not in {parse_dtype(a) for a in allowed}:
        raise DtypeError(f"dtype {value!r} is not allowed here" + _choices(allowed))
    return dtype


def _choices(allowed) -> str:
    return "" if allowed is None else f"; choose one of {', '.join(dtype_name(a) for a in allowed)}"


def parse_dtypes(values, allowed=None) -> list[torch.dtype]:
    """``parse_dtype`` of each value of a list; the error names the first bad one and its position."""
    if isinstance(values, (str, torch.dtype)):  # a lone name would be parsed letter by letter
        raise DtypeError(f"expected a list of dtypes, got the single value {values!r}")
    out = []
    for i, value in enumerate(values):
        try:
            out.append(parse_dtype(value, allowed))
        except DtypeError as exc:
            raise DtypeError(f"dtypes[{i}]: {exc}") from None
    return out


def parse_safetensors_dtype(code) -> torch.dtype:
    """The torch dtype of a safetensors header's dtype code (``"BF16"``); ``DtypeError`` if
    this project does not read that code."""
    if not isinstance(code, str) or code not in SAFETENSORS_DTYPES:
        raise DtypeError(f"safetensors dtype {code!r} is not supported; "
                         f"choose one of {', '.join(SAFETENSORS_DTYPES)}")
    return SAFETENSORS_DTYPES[code]
