"""Quantized linear layers: the checkpoint holds floats, the kernels read something else.

A linear layer delegates its parameters and its matmul to a *quant method* with vLLM's
interface:

- ``create_weights(layer, in_features, out_features, dtype)`` registers the tensors the
  kernel reads (for the quantized methods: ``qweight`` and ``weight_scale`` buffers);
- ``apply(layer, x)`` computes the layer's output.

``UnquantizedLinearMethod`` keeps a plain ``weight`` that the loaders write into directly:
checkpoint format is kernel format.

``Int8PerChannel`` and ``Fp8Block`` allocate their kernel tensors once, at create time,
and every later (re)load writes into them with ``copy_``: their ``data_ptr`` never
changes, which is what a captured CUDA graph needs. A checkpoint tensor reaches them in
two steps:

1. ``load_weights`` calls ``layer.weight.weight_loader`` as for an unquantized layer, so
   name mapping, q/k/v and gate/up fusion and tensor-parallel slicing are the same code.
   For a quantized layer ``layer.weight`` is a *shell* on the meta device: it has the
   checkpoint-format shape and dtype (after sharding and fusion) but no memory. Its loader
   (``QuantizedLinearMethod._stage``) materializes a full-precision *staging* tensor on
   the first shard that arrives and writes the shard into it.
2. ``process_weights_after_loading(model)`` hands every layer holding a staged weight to
   ``requantize_staged``: the requantization pass, all or nothing (a layer missing a shard,
   or a weight the quantizer refuses, changes no kernel tensor of any layer), into
   ``qweight`` and ``weight_scale`` in place, freeing the staging tensors.

Why free the staging tensor instead of keeping a float copy next to the quantized one:
keeping it would cost more memory than not quantizing at all. Freeing it means a hot
update re-creates one temporary float tensor per layer it touches, and a caller that
processes layer by layer holds about one layer of extra memory. Layers a (partial) update
does not touch are not staged, so processing leaves them exactly as they were. The
consequence: a fused layer must receive all its shards in an update (a quantized row
block mixes q, k and v rows), and a layer that got only some is refused before any kernel
tensor changes (or, for an update sent in chunks, waits staged for the rest).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.layers import fused_quant

QUANTIZATIONS = (None, "int8", "fp8")
FP8_MAX = 448.0        # largest finite float8_e4m3fn
FP8_BLOCK = 128        # DeepSeek-V3 / vLLM block-FP8 block size, in both dimensions


# ---- quantize / dequantize (pure functions: tests and chapters call them directly) -------

def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: the kernel format of ``Int8PerChannel``.

    ``w`` is a 2-D floating-point weight ``[out, in]`` in checkpoint format (any float
    dtype; ``out`` may be 0). Computed in float32, row by row: ``scale = max|row| / 127``
    (1 for an all-zero row), ``q = round(w / scale)`` with round-half-to-even (2.5 -> 2,
    3.5 -> 4, -2.5 -> -2), clamped to [-127, 127], so ``|w - q * scale| <= scale / 2``.

    Returns ``(q, scale)``: ``q`` int8 ``[out, in]`` and ``scale`` float32 ``[out]``, new
    tensors (``w`` is left as it was). Raises ``ValueError``, naming what was wrong, when
    ``w`` is not 2-D or holds NaN or infinite values (they would poison the row's scale).
    """
    # BEGIN EXERCISE ch03.quantize_int8
    if w.dim() != 2:
        raise ValueError(f"quantize_int8_per_channel needs a 2-D weight [out, in], got shape {tuple(w.shape)}")
    w = w.float()
    if not torch.isfinite(w).all():
        raise ValueError("quantize_int8_per_channel: the weight holds NaN or infinite values")
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale
    # END EXERCISE


def dequantize_int8_per_channel(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn with one scale per ``block x block`` tile: the kernel format of ``Fp8Block``.

    ``w`` is a 2-D floating-point weight ``[out, in]`` (any float dtype, any size: neither
    dimension need be a multiple of ``block``; either may be 0). Computed in float32.
    Tile ``(i, j)`` covers rows ``i*block ...`` and columns ``j*block ...``; tiles at the
    right and bottom edges are partial, each with a scale of its own values. Per tile:
    ``scale = max|tile| / 448`` (448 is the largest finite e4m3fn value; an all-zero tile
    gets 1), ``q = w / scale`` clamped to [-448, 448] and cast to ``torch.float8_e4m3fn``
    (the cast rounds to nearest, ties to even).

    Returns ``(q, scale)``: ``q`` float8_e4m3fn ``[out, in]`` (contiguous, no padding) and
    ``scale`` float32 ``[ceil(out/block), ceil(in/block)]``, new tensors. Raises
    ``ValueError``, naming what was wrong, when ``w`` is not 2-D or holds NaN or infinite
    values.
    """
    # BEGIN EXERCISE ch03.quantize_fp8
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_block needs a 2-D weight [out, in], got shape {tuple(w.shape)}")
    w = w.float()
    if not torch.isfinite(w).all():
        raise ValueError("quantize_fp8_block: the weight holds NaN or infinite values")
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = F.pad(w, (0, kb * block - k, 0, nb * block - n))
    tiles = padded.view(nb, block, kb, block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nb * block, kb * block)[:n, :k].contiguous(), scale
    # END EXERCISE


def expand_block_scale(scale: torch.Tensor, shape, block: int = FP8_BLOCK) -> torch.Tensor:
    n, k = shape
    return scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    return q.float() * expand_block_scale(scale, q.shape, block)


# ---- quant methods --------------------------------------------------------------------------

class UnquantizedLinearMethod:
    """A plain ``weight`` [out, in] in the model dtype; the loaders write straight into it."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype):
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader
        layer.weight.local_loader = layer.local_loader

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight)


class QuantizedLinearMethod:
    """Shared machinery: the kernel tensors made once, the meta-device ``weight`` shell and
    its staging loader (``requantize_staged`` turns what was staged into kernel format).
    Subclasses say how to quantize and how to multiply."""

    qweight_dtype: torch.dtype

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, ...]:
        raise NotImplementedError

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def create_weights(self, layer, in_features, out_features, dtype):
        # The kernel tensors: allocated here, once, and only ever written with copy_.
        layer.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=self.qweight_dtype))
        layer.register_buffer("weight_scale", torch.ones(self.scale_shape(out_features, in_features),
                                                         dtype=torch.float32))
        # Checkpoint-format shell: shape and dtype for the loaders and for validation, no memory.
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device="meta"),
                                    requires_grad=False)
        # The shell's two loaders stage through the layer's own two (see linear.py).
        layer.weight.weight_loader = functools.partial(self._stage, layer, layer.weight_loader)
        layer.weight.local_loader = functools.partial(self._stage, layer, layer.local_loader)
        layer.staging, layer.staged_shards = None, set()

    def _stage(self, layer, loader, param, loaded, shard_id=None):
        """The loaders of a quantized layer's ``weight`` shell: stage one checkpoint shard.

        ``create_weights`` binds ``layer`` and ``loader`` (``functools.partial``), so the
        model's load path calls this exactly as it calls an unquantized weight's loader.
        ``param``: the shell ``layer.weight`` (meta device: the checkpoint-format shape and
        dtype after fusion and sharding, no memory). ``loader``: the layer's own
        ``weight_loader`` (``loaded`` is the full checkpoint tensor) or ``local_loader``
        (``loaded`` is this rank's slice). ``shard_id``: None for a plain layer, "q"/"k"/"v"
        or 0/1 for fused ones.

        What it leaves: ``layer.staging``, one tensor per layer with the shell's shape and
        dtype on the kernel tensors' device, allocated by the first shard since the last
        pass and shared by every later one, each shard in its own rows (written by the
        layer's own loader: its shape checks, its slice); ``layer.staged_shards``, the ids
        received. The kernel tensors do not change. A shard the loader refuses (a
        ValueError naming the parameter) is not recorded.
        """
        if layer.staging is None:
            layer.staging = torch.empty(param.shape, dtype=param.dtype, device=layer.qweight.device)
            layer.staging.param_name = getattr(param, "param_name", "weight")  # loaders name it in errors
        if shard_id is None:
            loader(layer.staging, loaded)
        else:
            loader(layer.staging, loaded, shard_id)
        layer.staged_shards.add(shard_id)

    def dequantized_weight(self, layer) -> torch.Tensor:
        """The float weight [out, in] this layer's kernel effectively multiplies by."""
        raise NotImplementedError


class Int8PerChannel(QuantizedLinearMethod):
    """int8 weight, one float32 scale per output row (weight-only: activations stay float)."""

    qweight_dtype = torch.int8

    def scale_shape(self, out_features, in_features):
        return (out_features,)

    def quantize(self, w):
        # The fused kernels where they give this quantizer's exact result (fused_quant.py).
        if fused_quant.available(w) and fused_quant.agrees_with("int8", quantize_int8_per_channel, w.device, w.dtype):
            return fused_quant.quantize_int8_per_channel(w)
        return quantize_int8_per_channel(w)

    def dequantized_weight(self, layer):
        return dequantize_int8_per_channel(layer.qweight, layer.weight_scale)

    def apply(self, layer, x):
        # The per-row scale factors out of the dot product, so it is applied to the output
        # (an int8 kernel's epilogue); the int8 -> float cast of the weight is exact.
        return F.linear(x, layer.qweight.to(x.dtype)) * layer.weight_scale.to(x.dtype)


class Fp8Block(QuantizedLinearMethod):
    """float8_e4m3fn weight with 128x128 block scales (the DeepSeek-V3 recipe vLLM serves).

    On a GPU where ``torch._scaled_mm`` supports block scaling and both dimensions are
    multiples of 128, activations are quantized per token and 128-column group and the
    matmul runs in FP8; otherwise the weight is dequantized and multiplied in the model
    dtype (always on CPU). The choice is made per layer at create time, before any graph
    is captured.
    """

    qweight_dtype = torch.float8_e4m3fn

    def scale_shape(self, out_features, in_features):
        return (-(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK))

    def create_weights(self, layer, in_features, out_features, dtype):
        super().create_weights(layer, in_features, out_features, dtype)
        device = layer.qweight.device
        layer.fp8_scaled_mm = (device.type == "cuda" and in_features % FP8_BLOCK == 0
                               and out_features % FP8_BLOCK == 0 and scaled_mm_block_fp8_works(device, dtype))

    def quantize(self, w):
        if fused_quant.available(w) and fused_quant.agrees_with("fp8", quantize_fp8_block, w.device, w.dtype):
            return fused_quant.quantize_fp8_block(w)
        return quantize_fp8_block(w)

    def dequantized_weight(self, layer):
        return dequantize_fp8_block(layer.qweight, layer.weight_scale)

    def apply(self, layer, x):
        if layer.fp8_scaled_mm:
            y = fp8_block_matmul(x.reshape(-1, x.shape[-1]), layer.qweight, layer.weight_scale, x.dtype)
            return y.view(*x.shape[:-1], y.shape[-1])
        return F.linear(x, self.dequantized_weight(layer).to(x.dtype))


def fp8_block_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, out_dtype) -> torch.Tensor:
    """x [M, K] (float) times block-FP8 qweight [N, K]^T with ``torch._scaled_mm``.

    Activations get one scale per token and 128-column group (1x128), the weight one per
    128x128 tile; cuBLAS wants the activation scales column-major and the weight
    column-major, hence the transposes.
    """
    m, k = x.shape
    groups = x.float().reshape(m, k // FP8_BLOCK, FP8_BLOCK)
    amax = groups.abs().amax(dim=-1)
    x_scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    xq = (groups / x_scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(m, k)
    return torch._scaled_mm(xq, qweight.t(), scale_a=x_scale.t().contiguous().t(), scale_b=scale.t(),
                            out_dtype=out_dtype)


@functools.lru_cache(maxsize=None)
def scaled_mm_block_fp8_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch/cuBLAS build runs block-scaled FP8 ``_scaled_mm`` on ``device``
    and gets the right answer (support depends on the GPU, CUDA and torch versions)."""
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        w = torch.randn(256, 256, device=device, generator=gen)
        x = torch.randn(3, 256, device=device, generator=gen)
        q, s = quantize_fp8_block(w)
        y = fp8_block_matmul(x.to(dtype), q, s, dtype).float()
        ref = x @ dequantize_fp8_block(q, s).T
        return bool(((y - ref).norm() / ref.norm()) < 0.1)
    except Exception:  # any failure (unsupported GPU, layout, cuBLAS build) means: dequantize instead
        return False


# ---- choosing a method, and processing a whole model ---------------------------------------

def get_quant_method(quantization: str | None):
    """The quant method for an engine's ``quantization`` option (vLLM's names)."""
    if quantization is None:
        return UnquantizedLinearMethod()
    if quantization == "int8":
        return Int8PerChannel()
    if quantization == "fp8":
        return Fp8Block()
    raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")


def process_weights_after_loading(model: nn.Module, allow_pending: bool = False) -> list[str]:
    """Requantize every linear layer that received weights since the last call (the layers
    holding a staged weight, in module order: ``requantize_staged``); returns their names.

    A fused layer that got only some of its shards cannot be requantized yet. By default
    that refuses the whole pass before any kernel tensor changes, and all staged weights
    are dropped (the update failed; the engine keeps serving the weights it had). With
    ``allow_pending=True`` (chunked updates, where q may arrive in one bucket and k, v in
    the next) such a layer stays staged until its other shards arrive: its staging tensor
    is the per-layer buffer; ``pending_layers`` lists what is still waiting.
    """
    staged = {name: m for name, m in model.named_modules() if getattr(m, "staging", None) is not None}
    if not staged:
        return []  # nothing arrived (an unquantized model never stages)
    return requantize_staged(staged, allow_pending)


def requantize_staged(layers: dict[str, nn.Module], allow_pending: bool = False) -> list[str]:
    """The requantization pass: staged float weights into the live kernel tensors, all or nothing.

    ``layers``: {name: layer}, in module order, every one a quantized linear layer holding
    a staged weight: ``layer.staging`` (the full-precision ``[out, in]`` weight its loaders
    wrote since the last pass, fused and sliced), ``layer.staged_shards`` (the shard ids
    that arrived) and ``layer.shard_ids`` (the ids it needs). A layer is complete when
    every id of ``shard_ids`` arrived. ``layer.quant_method.quantize(w)`` returns the
    layer's new ``(q, scale)`` (the shapes and dtypes of ``layer.qweight`` and
    ``layer.weight_scale``; new tensors); it raises ValueError for a weight holding NaN or
    infinite values.

    Promises:
    - every complete layer ends with ``qweight`` and ``weight_scale`` holding its staged
      weight's quantization, integers and scales of the same call, written into the
      tensors it has (same storage, shape and dtype: captured CUDA graphs read those
      addresses, so they are never rebound), and keeps no float copy of the weight
      (``staging`` None, ``staged_shards`` empty). Returns the names of those layers, in
      the order of ``layers``;
    - an incomplete layer, with ``allow_pending``, stays staged exactly as it is (it waits
      for the rest of a chunked update) and is not returned; without it the pass raises
      ValueError naming the layer and the shards it lacks;
    - all or nothing: when the pass raises (an incomplete layer without ``allow_pending``,
      or an error from ``quantize``), no kernel tensor of any layer has changed, and every
      layer of ``layers`` holds no staged weight any more (the update failed);
    - memory: at no moment does the pass hold more than the staged weights it was given
      held when it started, plus one layer's quantization at work (quantized results are
      smaller than the float weights they come from).
    """
    # BEGIN EXERCISE ch03.requantize_layers
    missing = {name: [s for s in m.shard_ids if s not in m.staged_shards] for name, m in layers.items()}
    missing = {name: ids for name, ids in missing.items() if ids}
    ready = [(name, m) for name, m in layers.items() if name not in missing]
    results = []
    try:
        if missing and not allow_pending:
            name, ids = next(iter(missing.items()))
            raise ValueError(f"{name}: received shards {sorted(map(str, layers[name].staged_shards))} but not "
                             f"{[str(s) for s in ids]}; a quantized fused layer is requantized whole, so an "
                             f"update must send all of its shards")
        for _, m in ready:  # every layer quantized before any is written, so a refusal changes nothing
            results.append(m.quant_method.quantize(m.staging))
            m.staging = None  # its result takes the float copy's place
    except Exception:
        for m in layers.values():
            m.staging, m.staged_shards = None, set()
        raise
    for (_, m), (q, scale) in zip(ready, results):
        m.qweight.copy_(q)
        m.weight_scale.copy_(scale)
        m.staged_shards = set()
    return [name for name, _ in ready]
    # END EXERCISE


def pending_layers(model: nn.Module) -> dict[str, list[str]]:
    """{layer name: shards still missing} for quantized fused layers waiting for shards."""
    return {name: [str(s) for s in m.shard_ids if s not in m.staged_shards]
            for name, m in model.named_modules() if getattr(m, "staging", None) is not None}


def staged_bytes(model: nn.Module) -> int:
    """Bytes held by staging tensors right now (part of an update's extra memory)."""
    return sum(m.staging.numel() * m.staging.element_size()
               for m in model.modules() if getattr(m, "staging", None) is not None)


def discard_staged_weights(model: nn.Module) -> int:
    """Drop every staged (loaded but not yet processed) weight; returns how many. For an
    update that failed after its loaders ran: the kernel tensors were never touched, and a
    later processing must not pick up the half-made update."""
    staged = [m for m in model.modules() if getattr(m, "staging", None) is not None]
    for m in staged:
        m.staging, m.staged_shards = None, set()
    return len(staged)


def kernel_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the forward pass reads (parameters with storage, and buffers such as
    ``qweight`` and ``weight_scale``), by name: what must keep its address across updates.
    Checkpoint-format shells on the meta device are left out: no kernel reads them."""
    out = {name: p for name, p in model.named_parameters() if p.device.type != "meta"}
    out.update(model.named_buffers())
    return out
