"""Request bodies of the HTTP API: SGLang's field names, and the checks made before the engine sees them.

Unknown fields are ignored, as SGLang's own request classes do, so a client written for a
newer SGLang (which sends fields this engine has no use for) still works.
"""
from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from course_lib.server.errors import ApiError


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


def checkpoint_dir(req: DiskUpdateRequest) -> str:
    """The request's checkpoint directory, refused with a clear 400 unless it is an existing,
    readable directory holding a config.json (so ``../../etc`` goes no further)."""
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
    if not p.is_dir():
        raise ApiError(400, "bad_model_path", f"model_path {path!r} is not an existing directory")
    if not os.access(p, os.R_OK | os.X_OK):
        raise ApiError(400, "bad_model_path", f"model_path {path!r} is not readable by the server")
    if not (p / "config.json").is_file():
        raise ApiError(400, "bad_model_path", f"model_path {path!r} is not a checkpoint directory (no config.json)")
    return path
