"""A Qwen3-style decoder: RMSNorm, RoPE, grouped-query attention with q/k norm, SwiGLU.

The engine's parameters are not the checkpoint's: q/k/v are fused into ``qkv_proj`` and
gate/up into ``gate_up_proj``, and with tensor parallelism each rank holds a slice.
``packed_modules_mapping`` says which checkpoint names land in which fused parameter, and
``load_weights`` routes every checkpoint tensor through its parameter's ``weight_loader``
(an in-place copy). Start-up loading and hot updates both go through ``load_weights``;
``load_local_weights`` does the same for tensors already cut to this rank's part.
``hf_tensor_shapes`` lists the tensors (names and shapes) a Hugging Face checkpoint of
this model holds: what every reader and update validates against.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from course_lib.config import ModelConfig
from course_lib.layers import fused
from course_lib.layers.attention import Attention, AttentionMetadata
from course_lib.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from course_lib.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                      RowParallelLinear)
from course_lib.layers.norm import RMSNorm
from course_lib.layers.quant import get_quant_method
from course_lib.layers.rotary import RotaryEmbedding


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


class Qwen3Attention(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int, rotary: RotaryEmbedding,
                 quant_method=None):
        super().__init__()
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_attention_heads,
                                          config.num_key_value_heads, tp_rank, tp_size, quant_method)
        # This rank's heads (the layer above has refused counts that tp_size does not divide).
        self.num_heads, self.num_kv_heads = config.num_attention_heads // tp_size, config.num_key_value_heads // tp_size
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size, tp_rank, tp_size,
                                        quant_method)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.rotary = rotary  # shared by all layers; not a submodule, so no duplicate buffers
        self.attn = Attention(self.num_heads, self.num_kv_heads, d)
        self.head_dim = d

    def forward(self, positions, x, meta: AttentionMetadata):
        qkv = self.qkv_proj(x)
        if self.attn.fused_fits(x):  # q/k norm, rotary and the cache writes in one kernel
            r, a = self.rotary, self.attn
            q = fused.qkv_norm_rope_store(qkv, self.num_heads, self.num_kv_heads, self.q_norm.weight,
                                          self.k_norm.weight, self.q_norm.eps, r.cos, r.sin, positions,
                                          meta.slot_mapping, a.k_cache, a.v_cache)
            return self.o_proj(a.attend(q, meta))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class Qwen3MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int, quant_method=None):
        super().__init__()
        i = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [i, i], tp_rank, tp_size, quant_method)
        self.down_proj = RowParallelLinear(i, config.hidden_size, tp_rank, tp_size, quant_method)

    def forward(self, x):
        if fused.enabled(x):
            return self.down_proj(fused.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int, rotary: RotaryEmbedding,
                 quant_method=None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen3Attention(config, tp_rank, tp_size, rotary, quant_method)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Qwen3MLP(config, tp_rank, tp_size, quant_method)

    def forward(self, positions, x, meta):
        x = x + self.self_attn(positions, self.input_layernorm(x), meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, positions, normed, residual, meta, next_norm: RMSNorm):
        """The same layer with each residual add fused into the RMSNorm after it: takes
        this layer's normed input and the residual stream, returns the next norm's output
        (``next_norm``: the next layer's input norm, or the model's final norm) and the
        new residual stream."""
        normed, residual = fused.add_rms_norm(self.self_attn(positions, normed, meta), residual,
                                              self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        return fused.add_rms_norm(self.mlp(normed), residual, next_norm.weight, next_norm.eps)


class Qwen3Model(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int, quant_method=None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, tp_rank, tp_size, self.rotary, quant_method)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        x = self.embed_tokens(input_ids)
        if fused.enabled(x):  # the residual adds fused into the norms after them (same values)
            normed, residual = self.layers[0].input_layernorm(x), x
            nexts = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
            for layer, next_norm in zip(self.layers, nexts):
                normed, residual = layer.forward_fused(positions, normed, residual, meta, next_norm)
            return normed
        for layer in self.layers:
            x = layer(positions, x, meta)
        return self.norm(x)


class Qwen3ForCausalLM(nn.Module):
    # checkpoint module name -> (fused engine module, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # Checkpoint entries that are not weights of this model (older HF exports carry them).
    ignored_suffixes = ("rotary_emb.inv_freq",)

    def __init__(self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1, quantization: str | None = None):
        super().__init__()
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # Linear layers only: embeddings, the LM head and norms stay in the model dtype.
        self.quantization = quantization
        self.model = Qwen3Model(config, tp_rank, tp_size, get_quant_method(quantization))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for name, param in self.named_parameters():
            param.param_name = name  # loaders name the parameter in their errors

    def forward(self, input_ids, positions, meta) -> torch.Tensor:
        """Hidden states [T, hidden] for this step's tokens."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def map_checkpoint_name(self, name: str) -> tuple[str, object] | None:
        """HF tensor name -> (engine parameter name, shard id), or None for ignored entries.

        Raises KeyError for a name this model has no parameter for. Cached: updates map
        the same few hundred names every time.
        """
        cache = self.__dict__.setdefault("_name_cache", {})
        if name not in cache:
            cache[name] = self._map_name(name)
        return cache[name]

    def _map_name(self, name: str) -> tuple[str, object] | None:
        if name.endswith(self.ignored_suffixes):
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # tied: the embedding already holds it
        for ckpt, (fused, shard_id) in self.packed_modules_mapping.items():
            if f".{ckpt}." in name:
                target = name.replace(f".{ckpt}.", f".{fused}.")
                if target in self._params():
                    return target, shard_id
        if name in self._params():
            return name, None
        raise KeyError(f"checkpoint tensor {name!r} matches no parameter of this model")

    def _params(self) -> dict[str, nn.Parameter]:
        if not hasattr(self, "_param_cache"):
            self._param_cache = dict(self.named_parameters())
        return self._param_cache

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into the parameters in place; returns the checkpoint
        names loaded. Each tensor is checked (name, shape) before its copy."""
        return self._load(weights, "weight_loader")

    def load_local_weights(self, shards: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Like ``load_weights``, for tensors already cut to this rank's part (what a
        resharder delivers): each goes through its parameter's ``local_loader``, the
        second half of its ``weight_loader``. Returns the checkpoint names loaded."""
        return self._load(shards, "local_loader")

    def _load(self, weights, loader: str) -> set[str]:
        params = self._params()
        loaded = set()
        for name, tensor in weights:
            target = self.map_checkpoint_name(name)
            if target is None:
                continue
            param_name, shard_id = target
            param = params[param_name]
            load = getattr(param, loader)
            if shard_id is None:
                load(param, tensor)
            else:
                load(param, tensor, shard_id)
            loaded.add(name)
        return loaded
