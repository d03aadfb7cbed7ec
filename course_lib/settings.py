"""Every ``COURSE_LIB_*`` environment variable the package reads, in one place.

| variable | what it does | default |
|---|---|---|
| ``COURSE_LIB_API_KEY`` | the API key ``python -m course_lib serve`` requires (``--api-key`` wins) | none: no key |
| ``COURSE_LIB_READ_THREADS`` | threads the pinned disk reader reads a segment with; ``0``: the default | ``min(16, CPU count)`` |
| ``COURSE_LIB_READ_CHUNK_MB`` | the pinned disk reader's segment (and pinned buffer) size, in MiB | ``64`` |
| ``COURSE_LIB_PINNED_READER`` | ``0``: read checkpoints to a GPU the plain way, not through the pinned reader | on |
| ``COURSE_LIB_DISK_READER`` | which reader a disk update to a GPU uses: ``own`` (the pinned reader), ``instanttensor`` (the optional package; an error without it) or ``auto`` (InstantTensor when installed) | ``own`` |
| ``COURSE_LIB_COPY_PLAN`` | ``0``: unquantized one-rank updates take the general loaders, not the copy plan | on |
| ``COURSE_LIB_FUSED_KERNELS`` | ``0``: the GPU forward pass runs plain torch ops, not the fused Triton kernels (``layers/fused.py``); ``interpret``: the fused kernels also on the CPU, through Triton's interpreter (tests) | on |
| ``COURSE_LIB_DIRECT_QUANT`` | ``0``: quantized updates take the general path, not the direct requantization | on |
| ``COURSE_LIB_REGISTERED_COPY`` | how a registered bucket is copied: ``loop``, ``foreach``, ``graph`` or ``scatter`` | by device (``weights/commit/copy_table.py``) |
| ``COURSE_LIB_GROUP_CONNECT_TIMEOUT_S`` | seconds joining a weight-update process group may take | ``30`` |
| ``COURSE_LIB_MAX_STORAGE_BYTES`` | the most bytes one storage in an unpickled payload may declare | ``64 << 30`` (64 GiB) |

Each function reads the environment when called, so a test's ``monkeypatch.setenv`` is
seen by the next call. Where a module keeps a constant (``pinned_reader.CHUNK_BYTES``,
``READ_THREADS``, ``safe_pickle.MAX_STORAGE_BYTES``: scripts and tests set those
attributes), it reads it through here once, at import. A variable set to the empty
string counts as unset. An unusable value raises ``SettingsError`` naming the variable.
(``COURSE_LIB_ROOT`` belongs to the judge, ``practice/judging/``, not to the package.)
"""
from __future__ import annotations

import contextlib
import os

DEFAULT_READ_CHUNK_MB = 64
DEFAULT_GROUP_CONNECT_TIMEOUT_S = 30.0
DEFAULT_MAX_STORAGE_BYTES = 64 << 30


class SettingsError(ValueError):
    """An environment variable with a value that cannot be used; the message names it."""


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None  # set but empty: as if unset


def _switch(name: str) -> bool:
    """An on/off switch that is on unless set to "0" (to compare a fast path with the general one)."""
    return _raw(name) != "0"


def _number(name: str, kind, default, minimum):
    value = _raw(name)
    if value is None:
        return default
    try:
        number = kind(value)
    except ValueError:
        raise SettingsError(f"{name}={value!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not number >= minimum:  # "not >=" also refuses NaN
        raise SettingsError(f"{name}={value!r} must be at least {minimum}")
    return number


def api_key() -> str | None:
    """``COURSE_LIB_API_KEY``, or None (no key required)."""
    return _raw("COURSE_LIB_API_KEY")


def read_threads() -> int:
    """``COURSE_LIB_READ_THREADS``; unset or 0: ``min(16, os.cpu_count())`` (16 threads read
    a page-cached file at about 46 GB/s on a 16-core host; 8: 30, 1: 6)."""
    return _number("COURSE_LIB_READ_THREADS", int, 0, 0) or min(16, os.cpu_count() or 1)


def read_chunk_bytes() -> int:
    """``COURSE_LIB_READ_CHUNK_MB`` (at least 1), in bytes."""
    return _number("COURSE_LIB_READ_CHUNK_MB", int, DEFAULT_READ_CHUNK_MB, 1) << 20


def pinned_reader() -> bool:
    """False when ``COURSE_LIB_PINNED_READER=0``."""
    return _switch("COURSE_LIB_PINNED_READER")


def disk_reader() -> str:
    """``COURSE_LIB_DISK_READER``: "own" (default), "instanttensor" or "auto". Not "auto" by
    default: on the H200 InstantTensor's ring (outside torch's allocator) took a disk
    update past its memory bound at ~8B, and it was slower at ~1.7B (results/README.md)."""
    value = _raw("COURSE_LIB_DISK_READER") or "own"
    if value not in ("auto", "own", "instanttensor"):
        raise SettingsError(f"COURSE_LIB_DISK_READER={value!r}: use auto, own or instanttensor")
    return value


def copy_plan() -> bool:
    """False when ``COURSE_LIB_COPY_PLAN=0``."""
    return _switch("COURSE_LIB_COPY_PLAN")


@contextlib.contextmanager
def overridden(name: str, value: str):
    """Set one ``COURSE_LIB_*`` variable inside a ``with`` block, restoring it after (a
    benchmark comparing a fast path with the general one in the same process)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def fused_kernels() -> str:
    """``COURSE_LIB_FUSED_KERNELS``: "on" (default), "off" (``0``) or "interpret"."""
    value = _raw("COURSE_LIB_FUSED_KERNELS")
    if value is None or value == "1":
        return "on"
    if value == "0":
        return "off"
    if value == "interpret":
        return "interpret"
    raise SettingsError(f"COURSE_LIB_FUSED_KERNELS={value!r}: use 0, 1 or interpret")


def direct_quant() -> bool:
    """False when ``COURSE_LIB_DIRECT_QUANT=0``."""
    return _switch("COURSE_LIB_DIRECT_QUANT")


def registered_copy() -> str | None:
    """``COURSE_LIB_REGISTERED_COPY`` as set (the caller checks it against its copy modes), or None."""
    return _raw("COURSE_LIB_REGISTERED_COPY")


def group_connect_timeout_s() -> float:
    """``COURSE_LIB_GROUP_CONNECT_TIMEOUT_S`` (more than 0), else 30 s. Short on purpose: an
    engine joins on its serving thread, and a closed port or a trainer that never comes must
    not stall generation for the collective timeout (300 s)."""
    value = _number("COURSE_LIB_GROUP_CONNECT_TIMEOUT_S", float, DEFAULT_GROUP_CONNECT_TIMEOUT_S, 0.0)
    if value == 0:
        raise SettingsError("COURSE_LIB_GROUP_CONNECT_TIMEOUT_S=0: a group could never be joined; "
                            "give a number of seconds above 0")
    return value


def max_storage_bytes() -> int:
    """``COURSE_LIB_MAX_STORAGE_BYTES`` (at least 0), else 64 GiB."""
    return _number("COURSE_LIB_MAX_STORAGE_BYTES", int, DEFAULT_MAX_STORAGE_BYTES, 0)
