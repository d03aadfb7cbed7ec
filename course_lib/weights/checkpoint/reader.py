"""``CheckpointReader``: a Hugging Face checkpoint directory, read.

A checkpoint is ``config.json`` (``model_type: qwen3``) plus either ``model.safetensors``,
safetensors shards with ``model.safetensors.index.json``, or ``pytorch_model.bin`` /
``*.pt``, with HF tensor names (``model.layers.0.self_attn.q_proj.weight``).

The reader reads names, shapes and dtypes from the safetensors headers without touching
the data (what an update validates before it writes anything), and streams tensors one
at a time (what the loaders consume), read without a memory map (a file rewritten in
place while mapped would kill the process with SIGBUS). A tensor stored in two files is
refused, by cold starts and updates alike. Import it from ``course_lib.weights.checkpoint``.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from course_lib import settings
from course_lib.config import ConfigError, ModelConfig
from course_lib.weights.checkpoint import instanttensor_reader
from course_lib.weights.checkpoint.pinned_reader import iter_safetensors_to_gpu
from course_lib.weights.checkpoint.safetensors_format import (CheckpointError, check_safetensors_size, file_identity,
                                                   iter_safetensors_file, safetensors_dtype)



class CheckpointReader:
    """Read-only view of a checkpoint dir: its config, tensor metadata, and tensors."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.exists():
            raise CheckpointError(f"{self.path}: no such checkpoint directory")
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a directory")
        if not os.access(self.path, os.R_OK | os.X_OK):
            raise CheckpointError(f"{self.path}: directory is not readable")
        try:
            self.config = ModelConfig.from_pretrained(self.path)
        except ConfigError as exc:
            raise CheckpointError(str(exc)) from exc
        self.files, self.format = self._find_files()
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
        self._identity: dict[Path, tuple] = {}  # each safetensors file as metadata() validated it

    def _find_files(self) -> tuple[dict[str, Path], str]:
        """{tensor name or '*': file} and the format ('safetensors' or 'torch')."""
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: malformed index ({exc!r})") from exc
            files = {name: self.path / file for name, file in weight_map.items()}
            for file in set(files.values()):
                if not file.is_file():
                    raise CheckpointError(f"{index} names {file.name}, which is missing")
            return files, "safetensors"
        single = self.path / "model.safetensors"
        if single.is_file():
            return {"*": single}, "safetensors"
        shards = sorted(self.path.glob("*.safetensors"))
        if shards:
            return {f"*{k}": f for k, f in enumerate(shards)}, "safetensors"
        torch_files = sorted(self.path.glob("pytorch_model*.bin")) + sorted(self.path.glob("*.pt"))
        if torch_files:
            return {f"*{k}": f for k, f in enumerate(torch_files)}, "torch"
        raise CheckpointError(f"{self.path}: no weights (*.safetensors, pytorch_model*.bin or *.pt)")

    def _unique_files(self) -> list[Path]:
        return sorted(set(self.files.values()))

    def _load_torch_file(self, file: Path) -> dict[str, torch.Tensor]:
        try:
            # No memory map: a file truncated while mapped kills the process with SIGBUS.
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=False)
        except Exception as exc:  # torch raises several types for a bad file
            raise CheckpointError(f"{file}: cannot read ({exc})") from exc
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"{file}: expected a dict of tensors")
        return state

    @staticmethod
    def _safetensors_entries(file: Path) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        check_safetensors_size(file)
        try:
            with safe_open(str(file), framework="pt") as f:  # the library's own header checks
                return [(name, tuple(f.get_slice(name).get_shape()),
                         safetensors_dtype(f.get_slice(name).get_dtype(), file)) for name in f.keys()]
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises SafetensorError for bad headers
            raise CheckpointError(f"{file}: unreadable safetensors file ({exc})") from exc

    def metadata(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{name: (shape, dtype)} for every tensor, read from headers (no tensor data)."""
        if self._meta is not None:
            return self._meta
        meta, where = {}, {}
        for file in self._unique_files():
            if self.format == "torch":
                entries = [(name, tuple(t.shape), t.dtype) for name, t in self._load_torch_file(file).items()]
            else:
                entries = self._safetensors_entries(file)
            for name, shape, dtype in entries:
                if name in where:
                    # Refused by every reader alike (cold start and update): which copy is
                    # the weight would depend on the order the files are read in.
                    raise CheckpointError(f"{name} is stored twice, in {where[name].name} and in {file.name}; "
                                          f"a checkpoint must store each tensor once")
                meta[name], where[name] = (shape, dtype), file
            self._identity[file] = file_identity(file)
        self._meta = meta
        return meta

    def iter_tensors(self, names=None, device="cpu") -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) one at a time, file by file (optionally only ``names``).
        To a GPU, safetensors files go through parallel reads into pinned buffers (see
        pinned_reader.py). Either way a file rewritten or replaced since ``metadata()``
        validated it, or changed while it is read, is refused (``CheckpointError``)."""
        wanted = None if names is None else set(names)
        if (self.format == "safetensors" and torch.device(device).type == "cuda"
                and settings.pinned_reader()):
            if instanttensor_reader.reader_name(device) == "instanttensor":  # optional, same checks
                try:
                    yield from instanttensor_reader.iter_with_instanttensor(self._unique_files(), wanted, device,
                                                                            self._identity)
                    return
                except instanttensor_reader.InstantTensorRefused:  # raised before any tensor was handed out
                    if settings.disk_reader() == "instanttensor":
                        raise
            for file in self._unique_files():  # the same identity checks as the plain path below
                yield from iter_safetensors_to_gpu(file, wanted, device, self._identity.get(file))
            return
        for file in self._unique_files():
            if self.format == "torch":
                for name, t in self._load_torch_file(file).items():
                    if wanted is None or name in wanted:
                        yield name, t.to(device)
                continue
            try:  # no memory map: see iter_safetensors_file
                for name, t in iter_safetensors_file(file, wanted, self._identity.get(file)):
                    yield name, t.to(device)
            except OSError as exc:
                raise CheckpointError(f"{file}: cannot read tensor data ({exc})") from exc

    def nbytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.metadata().values())
