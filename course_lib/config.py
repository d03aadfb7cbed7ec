"""Configuration: the model's shape (read from an HF ``config.json``) and the engine's knobs.

``ModelConfig`` holds exactly the fields a Qwen3-style decoder needs and validates them,
so a checkpoint the model cannot build is refused with a message naming the field.
``structural_fields`` are the ones a hot update can never change (they fix tensor shapes);
``restart_fields`` change the numerics but cannot be changed in place either, and
``runtime_fields`` are applied by a hot update with the weights.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from course_lib.dtypes import DtypeError, dtype_name, parse_dtype

# The dtypes a checkpoint's torch_dtype may name, and the engine may compute in.
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ConfigError(ValueError):
    """A config the model cannot be built from; the message names the field."""


@dataclass
class ModelConfig:
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    bos_token_id: int = 256
    eos_token_id: int = 257
    model_type: str = "qwen3"

    # Fields that fix tensor shapes or the computation's structure: a hot update must
    # leave them unchanged (a change needs a restart).
    structural_fields = (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
        "model_type",
    )

    # Fields that change the numerics but cannot be changed in place: a hot update that
    # changes one is refused as needing a restart. max_position_embeddings sizes the rotary
    # tables and bounds max_model_len, which sized the KV pool and the batch budget;
    # rms_norm_eps is a number passed to the norm kernels, baked into captured CUDA graphs.
    restart_fields = ("max_position_embeddings", "rms_norm_eps")
    # Fields a hot update applies with the weights (see update/updater.py): the
    # rotary tables are recomputed in place for rope_theta; the token ids only steer the
    # tokenizer and the scheduler's stop check. torch_dtype is neither: it is the storage
    # dtype the tensors are checked against, cast into the engine's fixed compute dtype.
    runtime_fields = ("rope_theta", "bos_token_id", "eos_token_id")

    def __post_init__(self):
        self.validate()
        # "torch.bfloat16" (or torch.bfloat16) is kept as "bfloat16", the spelling config.json uses
        self.torch_dtype = dtype_name(self.torch_dtype)

    def validate(self) -> None:
        if self.model_type != "qwen3":
            raise ConfigError(f"model_type is {self.model_type!r}; this engine builds 'qwen3' models")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        try:
            parse_dtype(self.torch_dtype, allowed=DTYPES)
        except DtypeError:
            raise ConfigError(f"torch_dtype {self.torch_dtype!r} is not one of {sorted(DTYPES)}") from None
        if self.vocab_size < 258:
            raise ConfigError(f"vocab_size must be at least 258 (256 bytes + BOS + EOS), got {self.vocab_size}")
        for name in ("bos_token_id", "eos_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ConfigError(f"{name} {getattr(self, name)} is outside the vocabulary")

    @property
    def dtype(self) -> torch.dtype:
        return parse_dtype(self.torch_dtype)

    @property
    def num_parameters(self) -> int:
        h, i, v, d = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h + 2 * d
        embeddings = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embeddings + h

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        """Build from an HF config dict (transformers 4.x or 5.x spelling), ignoring extras."""
        raw = dict(raw)
        if raw.get("torch_dtype") is None and raw.get("dtype") is not None:  # transformers 5 renamed it
            raw["torch_dtype"] = raw["dtype"]
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if raw.get("rope_theta") is None and isinstance(rope, dict) and "rope_theta" in rope:
            raw["rope_theta"] = rope["rope_theta"]
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type not in ("default", None):
            raise ConfigError(f"rope scaling {rope_type!r} is not supported (only default RoPE)")
        if raw.get("attention_bias"):
            raise ConfigError("attention_bias=true is not supported by this Qwen3 model")
        if raw.get("head_dim") is None and "hidden_size" in raw and "num_attention_heads" in raw:
            raw["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
        if raw.get("num_key_value_heads") is None and "num_attention_heads" in raw:
            raw["num_key_value_heads"] = raw["num_attention_heads"]
        for name in ("eos_token_id", "bos_token_id"):
            if isinstance(raw.get(name), list):
                raw[name] = raw[name][0]
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in known and v is not None}
        try:
            return cls(**kwargs)
        except TypeError as exc:  # pragma: no cover - dataclass signature errors
            raise ConfigError(str(exc)) from exc

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        file = path / "config.json"
        if not file.is_file():
            raise ConfigError(f"{path}: no config.json (not a Hugging Face checkpoint directory)")
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{file}: malformed JSON ({exc})") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{file}: expected a JSON object")
        return cls.from_dict(raw)

    def to_hf_dict(self) -> dict:
        """The config.json transformers' Qwen3ForCausalLM reads."""
        d = asdict(self)
        d.update(architectures=["Qwen3ForCausalLM"], hidden_act="silu", attention_bias=False,
                 attention_dropout=0.0, use_sliding_window=False, sliding_window=None,
                 max_window_layers=self.num_hidden_layers, rope_scaling=None,
                 initializer_range=0.02, use_cache=True)
        return d

    def structural_diff(self, other: "ModelConfig", fields=None) -> dict:
        """{field: (self, other)} for every structural field (or every one of ``fields``) that differs."""
        return {name: (getattr(self, name), getattr(other, name))
                for name in (fields or self.structural_fields) if getattr(self, name) != getattr(other, name)}


def is_cuda(device) -> bool:
    """True when ``device`` (a string such as "cuda:1", or a torch.device) is a GPU."""
    return torch.device(device).type == "cuda"


def resolve_dtype(dtype, device, checkpoint_dtype: torch.dtype) -> torch.dtype:
    """None: float32 on CPU (exact, and what the CPU tests compare); on GPU the checkpoint's
    half-precision dtype, or bfloat16 for a float32 checkpoint (as vLLM's 'auto')."""
    if dtype is None:
        if not is_cuda(device):
            return torch.float32
        return checkpoint_dtype if checkpoint_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    try:
        return parse_dtype(dtype, allowed=DTYPES.values())
    except DtypeError:
        raise ConfigError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}") from None


LOAD_FORMATS = ("auto", "dummy")


@dataclass
class EngineConfig:
    """Every option of the serving engine (not of the model), as ``Engine(...)`` takes them.

    ``None`` leaves an option to ``resolved(model_config)``, which decides it for the model
    (dtype, CUDA graphs, context length, batch budget, KV pool size). An engine's
    ``config`` is resolved: it says exactly how the engine was built, and
    ``Engine(path, config=engine.config)`` builds another one like it (the hot == cold
    oracle does). ``ModelRunner`` and ``Scheduler`` take a resolved config."""
    device: str = "cpu"
    dtype: torch.dtype | str | None = None  # None: see resolve_dtype
    block_size: int = 16
    num_kv_blocks: int | None = None        # None: enough for max_num_seqs full-length sequences
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None  # None: max(4096, max_model_len)
    max_model_len: int | None = None        # None: 1024; never more than the model's positions
    enable_prefix_caching: bool = True
    enable_cuda_graph: bool | None = None   # None: on for CUDA devices
    cuda_graph_batch_sizes: list[int] = field(default_factory=list)  # empty: 1, 2, 4, ... max_num_seqs
    seed: int = 0                           # the n-th unseeded request samples from seed + n
    quantization: str | None = None         # None, "int8" or "fp8" (layers/quant.py); fixed at start-up
    tp_rank: int = 0                        # this process's rank of a TPEngine (engine/tp.py)
    tp_size: int = 1
    load_format: str = "auto"               # "dummy": random weights until the real ones arrive

    def __post_init__(self):
        self.cuda_graph_batch_sizes = list(self.cuda_graph_batch_sizes or [])
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be positive, got {value}")
        if (self.max_num_batched_tokens is not None and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_model_len ({self.max_model_len}) so any prompt can be prefilled")

    @property
    def is_cuda(self) -> bool:
        return is_cuda(self.device)

    def resolved(self, model_config: ModelConfig) -> "EngineConfig":
        """A copy with every ``None`` option decided for ``model_config`` (see the fields).
        Resolving a resolved config changes nothing."""
        if self.is_cuda and not torch.cuda.is_available():
            raise RuntimeError("device='cuda' but torch sees no GPU")
        graphs = self.is_cuda if self.enable_cuda_graph is None else self.enable_cuda_graph
        if graphs and not self.is_cuda:
            raise ConfigError("enable_cuda_graph=True needs device='cuda'")
        max_model_len = min(self.max_model_len or 1024, model_config.max_position_embeddings)
        return replace(self, dtype=resolve_dtype(self.dtype, self.device, model_config.dtype),
                       enable_cuda_graph=graphs, max_model_len=max_model_len,
                       max_num_batched_tokens=self.max_num_batched_tokens or max(4096, max_model_len),
                       num_kv_blocks=self.num_kv_blocks or self.max_num_seqs * -(-max_model_len // self.block_size))
