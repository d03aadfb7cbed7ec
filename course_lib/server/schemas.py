"""Request bodies of the HTTP API: SGLang's field names, and the checks made before the engine sees them.

Unknown fields are ignored, as SGLang's own request classes do, so a client written for a
newer SGLang (which sends fields this engine has no use for) still works.
"""
from __future__ import annotations

import math
import os
import socket
import stat
import time
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from course_lib.dtypes import DtypeError, parse_dtype
from course_lib.server.errors import ApiError
from course_lib.weights.transports import dist as dist_transport


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


Version = str | int | None  # SGLang sends strings; a trainer's step number is accepted too


def version_text(v: Version) -> str | None:
    return None if v is None else str(v)


class GenerateRequest(Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict | list[dict] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False


class PauseRequest(Body):
    mode: str = "abort"  # abort / retract / in_place (SGLang), also wait / keep; the engine checks it


class FlushRequest(Body):
    timeout: float | None = None  # accepted for SGLang clients; flushing never blocks here


class DiskUpdateRequest(Body):
    model_path: str | None = None
    model_dir: str | None = None  # older SGLang clients' name for model_path
    weight_version: Version = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    load_format: str | None = None


class TensorUpdateRequest(Body):
    serialized_named_tensors: list[str]  # one base64 payload per tensor-parallel rank
    load_format: str | None = None
    flush_cache: bool = True
    weight_version: Version = None
    abort_all_requests: bool = False


class OneCallRequest(Body):
    """``/sync_weights``: which update route's fields the body also holds, and the pause around it."""
    transport: Literal["disk", "tensor", "registered", "distributed"]
    pause_mode: str | None = None   # abort / wait / keep / in_place / retract; None: no pause
    resume: bool | None = None      # continue afterwards (None: when this call paused)


class RegisterRequest(Body):
    serialized_payload: str  # RegisteredSender.registration(): the buffers' handles and the whole layout
    partial: bool = False
    copy_mode: str | None = None  # loop / foreach / graph / scatter; None: the engine's default


class RegisteredUpdateRequest(Body):
    # Strict: a bucket "3" or an epoch 1.0 is a client bug, not a number to guess at.
    buckets: list[StrictInt]
    epoch: StrictInt
    weight_version: Version = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class InitGroupRequest(Body):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=0)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str | None = None


class DistributedUpdateRequest(Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    weight_version: Version = None
    load_format: str | None = None
    abort_all_requests: bool = False


class DestroyGroupRequest(Body):
    group_name: str = "weight_update_group"


class VersionRequest(Body):
    new_version: str | int


class WeightsByNameRequest(Body):
    name: str
    truncate_size: int = Field(default=100, ge=1)


# Formats the disk reader understands on its own (it detects safetensors or .bin/.pt).
DISK_LOAD_FORMATS = (None, "auto", "safetensors", "pt")


MAX_ANNOUNCED_BYTES = 1 << 40  # a broadcast announcing more than this is refused before any receive


def _entries_are_regular(p: Path, path: str) -> None:
    """Every top-level entry is a directory or a regular file (symlinks followed): the
    reader must never open a FIFO (it would block the engine thread) or a device."""
    with os.scandir(p) as entries:
        for n, entry in enumerate(entries):
            if n > 10_000:
                raise ApiError(400, "bad_model_path", f"model_path {path!r} holds more than 10,000 entries")
            try:
                mode = entry.stat().st_mode
            except OSError as exc:
                raise ApiError(400, "bad_model_path", f"model_path {path!r}: {entry.name} cannot be read ({exc})")
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise ApiError(400, "bad_model_path", f"model_path {path!r}: {entry.name} is not a regular file "
                                                      f"or directory")


def checkpoint_dir(req: DiskUpdateRequest) -> str:
    """The request's checkpoint directory, refused with a clear 400 unless it is an existing,
    readable directory of regular files holding a config.json (so ``../../etc`` goes no
    further, and a FIFO named model.safetensors never blocks the reader)."""
    if req.model_path and req.model_dir and req.model_path != req.model_dir:
        raise ApiError(400, "bad_request", "model_path and model_dir disagree; send one of them")
    path = req.model_path or req.model_dir
    if not path:
        raise ApiError(400, "bad_request", "model_path is required (a Hugging Face checkpoint directory)")
    if req.load_format not in DISK_LOAD_FORMATS:
        raise ApiError(400, "bad_request", f"load_format {req.load_format!r} is not supported for disk updates; "
                                           f"expected one of {list(DISK_LOAD_FORMATS)}")
    if "\x00" in path:
        raise ApiError(400, "bad_model_path", "model_path contains a NUL byte")
    p = Path(path)
    try:
        is_dir = stat.S_ISDIR(os.stat(p).st_mode)
    except OSError as exc:  # missing, a component over 255 characters, a loop of links, ...
        raise ApiError(400, "bad_model_path", f"model_path {path[:300]!r} cannot be used: {exc.strerror}") from None
    if not is_dir:
        raise ApiError(400, "bad_model_path", f"model_path {path!r} is not an existing directory")
    if not os.access(p, os.R_OK | os.X_OK):
        raise ApiError(400, "bad_model_path", f"model_path {path!r} is not readable by the server")
    if not (p / "config.json").is_file():
        raise ApiError(400, "bad_model_path", f"model_path {path!r} is not a checkpoint directory (no config.json)")
    _entries_are_regular(p, path)
    return path


def check_backend(backend: str | None, device: str) -> None:
    if backend not in (None, "gloo", "nccl"):
        raise ApiError(400, "bad_request", f"backend {backend!r} is not supported; expected 'gloo' or 'nccl'")
    if backend == "nccl" and torch.device(device).type != "cuda":
        raise ApiError(400, "bad_request", f"backend 'nccl' needs a CUDA server; this one runs on {device}: "
                                           f"use backend 'gloo'")


def probe_rendezvous(address: str, port: int) -> None:
    """Wait until the trainer's rendezvous store accepts a TCP connection (it may still be
    starting: retried until the group connect timeout); a 400 naming the address if it never
    does. Runs off the engine thread, so generation goes on meanwhile."""
    deadline = time.monotonic() + dist_transport.connect_timeout_s()
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((address, port), timeout=max(left, 0.1)).close()
            return
        except OSError as exc:
            if left <= 0:
                raise ApiError(400, "bad_request", f"nothing accepted connections at {address}:{port} (the "
                                                   f"trainer's rendezvous, master_address/master_port) within "
                                                   f"{dist_transport.connect_timeout_s()} s: {exc}") from None
            time.sleep(min(0.1, max(left, 0)))


def check_announced_tensors(req: DistributedUpdateRequest) -> None:
    """names, dtypes and shapes agree, every dtype is a torch dtype and every shape is
    non-negative and sized sanely, before the engine allocates a receive buffer for them."""
    if not len(req.names) == len(req.dtypes) == len(req.shapes):
        raise ApiError(400, "bad_request", f"names, dtypes and shapes differ in length "
                                           f"({len(req.names)}, {len(req.dtypes)}, {len(req.shapes)})")
    total = 0
    for i, (dtype, shape) in enumerate(zip(req.dtypes, req.shapes)):
        try:
            d = parse_dtype(dtype)
        except DtypeError:
            raise ApiError(400, "bad_request", f"dtypes[{i}]: {dtype!r} is not a torch dtype") from None
        if any(n < 0 for n in shape):
            raise ApiError(400, "bad_request", f"shapes[{i}]: {shape} has a negative dimension")
        total += math.prod(shape) * d.itemsize
        if total > MAX_ANNOUNCED_BYTES:
            raise ApiError(400, "bad_request", f"shapes[{i}]: {shape} takes the announced update past "
                                               f"{MAX_ANNOUNCED_BYTES} bytes")
