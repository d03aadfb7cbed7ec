"""Hugging Face checkpoint directories: make them from a seed, and read them.

A checkpoint is ``config.json`` (``model_type: qwen3``) plus either ``model.safetensors``,
safetensors shards with ``model.safetensors.index.json``, or ``pytorch_model.bin`` /
``*.pt``, with HF tensor names (``model.layers.0.self_attn.q_proj.weight``). Nothing is
ever downloaded: ``make_random`` writes a checkpoint from a seed, in sizes from ``tiny``
(CPU tests, milliseconds) to ``qwen3-8b`` (GPU benchmarks).

``CheckpointReader`` reads names, shapes and dtypes from the safetensors headers without
touching the data (what the update transaction validates before it writes anything), and
streams tensors one at a time (what the loaders consume).
"""
from __future__ import annotations

import json
import os
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from course_lib.config import ConfigError, ModelConfig

PRESETS: dict[str, ModelConfig] = {
    # CPU tests and chapters: well under a second to make and to load.
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "small": ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=16),
    # GPU benchmark sizes: the shapes of the public Qwen3 models, random values.
    "qwen3-0.6b": ModelConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                              num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                              head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True,
                              torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645),
    "qwen3-1.7b": ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                              num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                              head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True,
                              torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645),
    "qwen3-8b": ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                            head_dim=128, max_position_embeddings=40960, tie_word_embeddings=False,
                            torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645),
}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read; the message names the file and the fault."""


def preset(name: str, **overrides) -> ModelConfig:
    """A copy of a named preset config, with fields overridden."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF Qwen3 checkpoint of this config holds, with its shape, in file order."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def random_tensor(name: str, shape, seed: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """The tensor ``make_random`` writes for ``name``: a function of (seed, name) alone,
    so sharding or the order of writing never changes a value."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.endswith("norm.weight"):
        # Norm gains near 1, perturbed so that a wrongly loaded norm shows in the logits.
        t = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
    elif name.endswith("embed_tokens.weight"):
        t = torch.randn(shape, generator=gen, device=device)
    else:
        # 1/sqrt(fan_in) keeps activations O(1), so logits are decisive (no near-ties
        # that would make greedy outputs fragile to rounding).
        t = torch.randn(shape, generator=gen, device=device) * shape[-1] ** -0.5
    return t.to(dtype)


def random_state_dict(config: ModelConfig, seed: int = 0, dtype=None, device="cpu") -> dict[str, torch.Tensor]:
    dtype = dtype or config.dtype
    return {name: random_tensor(name, shape, seed, dtype, device)
            for name, shape in hf_tensor_shapes(config).items()}


def write_checkpoint(path, config: ModelConfig, tensors: dict[str, torch.Tensor],
                     max_shard_size: int | None = None) -> Path:
    """Write ``tensors`` as an HF checkpoint dir: one safetensors file, or shards of at most
    ``max_shard_size`` bytes with ``model.safetensors.index.json``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    if max_shard_size is None:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map, total = {}, 0
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path


def make_random(path, config: ModelConfig | str = "tiny", seed: int = 0, dtype=None,
                max_shard_size: int | None = None, device="cpu") -> Path:
    """Write a random Qwen3 checkpoint to ``path`` (a preset name or a ModelConfig).

    ``dtype`` defaults to the config's ``torch_dtype``; the written config records it.
    ``device="cuda"`` draws the numbers on the GPU (fast for multi-GB presets; the values
    differ from a CPU draw but are just as reproducible).
    """
    config = preset(config) if isinstance(config, str) else config
    if dtype is not None:
        config = replace(config, torch_dtype=str(dtype).removeprefix("torch."))
    tensors = random_state_dict(config, seed, config.dtype, device)
    return write_checkpoint(path, config, tensors, max_shard_size)


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
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # torch raises several types for a bad file
            raise CheckpointError(f"{file}: cannot read ({exc})") from exc
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"{file}: expected a dict of tensors")
        return state

    def metadata(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{name: (shape, dtype)} for every tensor, read from headers (no tensor data)."""
        if self._meta is not None:
            return self._meta
        meta = {}
        for file in self._unique_files():
            if self.format == "torch":
                for name, t in self._load_torch_file(file).items():
                    meta[name] = (tuple(t.shape), t.dtype)
                continue
            _check_safetensors_size(file)
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        sl = f.get_slice(name)
                        meta[name] = (tuple(sl.get_shape()), _st_dtype(sl.get_dtype(), file))
            except CheckpointError:
                raise
            except Exception as exc:  # safetensors raises SafetensorError for bad headers
                raise CheckpointError(f"{file}: unreadable safetensors file ({exc})") from exc
        self._meta = meta
        return meta

    def iter_tensors(self, names=None, device="cpu") -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) one at a time, file by file (optionally only ``names``).
        To a GPU, safetensors files go through pinned buffers (see pinned_reader.py)."""
        wanted = None if names is None else set(names)
        if (self.format == "safetensors" and torch.device(device).type == "cuda"
                and os.environ.get("COURSE_LIB_PINNED_READER", "1") != "0"):
            from course_lib.weights.pinned_reader import iter_safetensors_to_gpu
            for file in self._unique_files():
                yield from iter_safetensors_to_gpu(file, wanted, device)
            return
        for file in self._unique_files():
            if self.format == "torch":
                for name, t in self._load_torch_file(file).items():
                    if wanted is None or name in wanted:
                        yield name, t.to(device)
                continue
            try:
                with safe_open(str(file), framework="pt", device=str(device)) as f:
                    for name in f.keys():
                        if wanted is None or name in wanted:
                            yield name, f.get_tensor(name)
            except Exception as exc:
                if isinstance(exc, CheckpointError):
                    raise
                raise CheckpointError(f"{file}: cannot read tensor data ({exc})") from exc

    def nbytes(self) -> int:
        return sum(_numel(shape) * dtype.itemsize for shape, dtype in self.metadata().values())


def read_safetensors_header(file: Path) -> tuple[dict, int]:
    """(tensor entries of the header, byte offset where the data starts); CheckpointError if unreadable."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if header_len <= 0 or 8 + header_len > size:
                raise CheckpointError(f"{file}: unreadable safetensors file (header length {header_len} "
                                      f"does not fit in {size} bytes)")
            header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        for v in header.values():
            v["data_offsets"][1]  # every entry must carry its byte offsets
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise CheckpointError(f"{file}: unreadable safetensors file (bad header: {exc})") from exc
    return header, 8 + header_len


def _check_safetensors_size(file: Path) -> None:
    """A truncated file is caught here, from its header, before any tensor is read: the
    header says where the last tensor's bytes end, and the file must reach that far."""
    header, data_start = read_safetensors_header(file)
    need = data_start + max((v["data_offsets"][1] for v in header.values()), default=0)
    size = file.stat().st_size
    if need > size:
        raise CheckpointError(f"{file}: truncated: the header needs {need} bytes, the file has {size}")


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I8": torch.int8,
              "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn}


def _st_dtype(code: str, file) -> torch.dtype:
    if code not in _ST_DTYPES:
        raise CheckpointError(f"{file}: unsupported tensor dtype {code}")
    return _ST_DTYPES[code]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
