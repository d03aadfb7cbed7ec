"""Requantizing a hot update straight into the live kernel tensors, with one check.

The general path of an in-memory update on a quantized engine (``quant.py``) stages each
layer's float weight through the loaders, then requantizes it whole and copies the
result in: per weight element of a bf16 checkpoint that is about 11 bytes of memory
traffic (the copy into the staging tensor, the two kernel passes over it, the quantized
temporary, the copy into ``qweight``), against 4 for a plain copy of the checkpoint.
Here each incoming checkpoint tensor is quantized straight into its own rows of the
layer's ``qweight`` and ``weight_scale`` (the rows ``shard_rows`` names: the same
answer the loaders use): one pass computes every scale and counts non-finite values
into small new tensors (one float per row for int8, one per 128x128 tile for FP8), then
ONE synchronization checks the whole update, and only then a second pass writes the
quantized values in place and the scales are copied in: about 5 bytes per element, no
staging tensor, and a refused update (NaN or inf in any quantized tensor) changes nothing.

Why the bits are the general path's: int8 scales are per row and FP8 scales per tile,
so quantizing a shard alone gives exactly the rows the whole fused weight would get,
as long as no tile mixes two shards. So for FP8 every shard must start on a 128-row
boundary and end on one (or at the layer's last row). And the quantizer must be the
reference (``exercises.is_reference``); the fused kernels run where they agree with it
(``fused_quant.agrees_with``, as the general path decides), else it runs on each shard.
Unquantized tensors (norms, embedding) are written as the general path writes them,
NaN included: only ``check_finite`` refuses those.

When it runs, and otherwise the general path runs (the engine asks ``model_reason``
once and ``update_reason`` per update, before choosing its writer; ``apply`` asks both):
- a quantized model on one rank (a tensor-parallel rank's loaders cut each tensor),
  ``COURSE_LIB_DIRECT_QUANT`` not "0" (to compare the two paths);
- every part whose work it does its own way is the instructor edition's
  (``exercises.is_reference``: the edition's marker; ``why_not`` says which is not): in the student edition
  those are the learner's parts (the requantization pass, loaders, quantizers; and the
  staging loader wherever it was replaced), and the general path runs them, so a wrong
  part is never hidden behind this one;
- the update brings every shard of each fused layer it touches (q, k and v; gate and
  up), no layer waits for shards of an earlier chunk, and (FP8) every shard owns its tiles.
  A fused layer with a shard missing is refused before any write, as the general path
  refuses it; a chunked update (``allow_pending``) leaves it to the general path instead.
Tensors of unquantized parameters (norms, embedding, LM head) take the general commit
step (``copy_in_place``: the loaders), after the check.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from course_lib import settings
from course_lib.exercises import is_reference
from course_lib.layers import fused_quant, quant
from course_lib.layers.linear import LinearBase
from course_lib.models.qwen3 import hf_tensor_shapes
from course_lib.weights.commit.validate import UpdateError
from course_lib.weights.commit.copy_plan import copy_in_place

# Per quantization: its quant method, the reference quantizer that method calls (a
# module-level function of quant.py, looked up when used, as the method looks it up) and
# that quantizer's exercise.
QUANTIZERS = {"int8": (quant.Int8PerChannel, "quantize_int8_per_channel", "ch03.quantize_int8"),
              "fp8": (quant.Fp8Block, "quantize_fp8_block", "ch03.quantize_fp8")}

def reference_parts(kind: str, layer_type: type = LinearBase) -> dict[str, object]:
    """{label: the function as it is now} for the parts the general
    path runs on a layer of ``layer_type`` quantized as ``kind`` ("int8", "fp8") and this
    path does not: the loaders' slice and copy, the staging, the requantization pass and
    the quantizer (looked up now, so a replaced one is seen)."""
    method_type, quantizer, exercise = QUANTIZERS[kind]
    return {
        "ch01.tp_slice": layer_type._shard,
        "ch01.local_loader": layer_type.local_loader,
        f"{method_type.__name__}._stage": method_type._stage,
        "ch03.requantize_layers": quant.requantize_staged,
        f"{method_type.__name__}.quantize": method_type.quantize,
        exercise: getattr(quant, quantizer),
    }


class Shard(NamedTuple):
    """Where one checkpoint tensor of a quantized linear layer lands."""
    name: str            # checkpoint name
    layer: str           # the layer's module name
    module: nn.Module
    shard_id: object     # None, "q"/"k"/"v", 0/1
    first: int           # its first row in the layer's (fused) qweight
    rows: int
    own_tiles: bool      # FP8: the 128-row blocks it covers hold no other shard's rows


class Plan:
    """Per checkpoint name of a quantized linear layer, its ``Shard`` (worked out once from
    the layers' own ``shard_rows``), and the quantized layers by name."""

    def __init__(self, model: nn.Module):
        self.shards: dict[str, Shard] = {}
        self.layers: dict[str, nn.Module] = {}
        for name in hf_tensor_shapes(model.config):
            target = model.map_checkpoint_name(name)
            if target is None:
                continue  # a tied LM head: the embedding holds it
            param_name, shard_id = target
            layer = param_name.rpartition(".")[0]
            module = model.get_submodule(layer)
            if not isinstance(getattr(module, "quant_method", None), quant.QuantizedLinearMethod):
                continue  # norms, embedding, LM head: the general commit step writes them
            first, rows = module.shard_rows(shard_id)
            end = first + rows
            own = first % quant.FP8_BLOCK == 0 and (end % quant.FP8_BLOCK == 0 or end == module.out_features)
            self.shards[name] = Shard(name, layer, module, shard_id, first, rows, own)
            self.layers[layer] = module


def plan(model: nn.Module) -> Plan:
    """The model's plan (made on first use, then kept, like ``CopyPlan``: the layers and
    their rows never change between updates)."""
    found = model.__dict__.get("_direct_quant_plan")
    if found is None:
        found = model.__dict__["_direct_quant_plan"] = Plan(model)
    return found


def why_not(model: nn.Module) -> str | None:
    """None when the direct path may take this model's updates; else why it may not
    (the maintainers' switch first, then ``model_reason``)."""
    if not settings.direct_quant():
        return "COURSE_LIB_DIRECT_QUANT=0"
    return model_reason(model)


def model_reason(model: nn.Module) -> str | None:
    """Why this model's updates may never take the direct path, or None: not quantized (or
    not a kind this path writes), a tensor-parallel rank, or a part it stands in for that
    is not the instructor edition's. An engine asks once (``update/port.py``'s ``Parts``)."""
    kind = getattr(model, "quantization", None)
    if kind is None:
        return "the model is not quantized"
    if kind not in QUANTIZERS:
        return f"quantization {kind!r}: not one this path writes"
    if getattr(model, "tp_size", 1) != 1:
        return "a tensor-parallel rank: its loaders cut each tensor"
    kinds = {(type(m), m.quant_method) for m in model.modules()
             if isinstance(getattr(m, "quant_method", None), quant.QuantizedLinearMethod)}
    for layer_type, method in kinds:
        if type(method) is not QUANTIZERS[kind][0]:
            return f"{type(method).__name__} is not the {kind} quant method this path knows"
        if vars(method):  # the methods keep no state: anything here replaces a part
            return f"the quant method's {sorted(vars(method))} are replaced on the instance"
        for label, func in reference_parts(kind, layer_type).items():
            if not is_reference(func, label if label.startswith("ch") else None):
                return f"{label} is not the instructor edition's: the general path runs it"
    try:  # last: the plan asks the layers' shard_rows (chapter 01's parts)
        plan(model)
    except Exception as exc:  # noqa: BLE001 - unwritten or failing: the general path meets it, in its own words
        return f"no plan: {type(exc).__name__}: {exc}"
    return None


def update_reason(model: nn.Module, names, chunk: bool) -> str | None:
    """Why this update (checkpoint ``names``) goes to the general path although the model
    may take the direct one, or None: an earlier chunk left layers waiting for shards, a
    fused layer's other shards come in a later chunk (``chunk``), or (FP8) a shard does
    not own its 128x128 tiles. Asked with names only, before anything is received."""
    found = plan(model)
    if any(m.staging is not None for m in found.layers.values()):
        return "an earlier chunk left layers waiting for shards: they finish on the general path"
    arrived: dict[str, set] = {}
    for name in names:
        s = found.shards.get(name)
        if s is not None:
            arrived.setdefault(s.layer, set()).add(s.shard_id)
    if chunk and any(set(found.layers[layer].shard_ids) - ids for layer, ids in arrived.items()):
        return "a fused layer's other shards come in a later chunk: the general path stages this one"
    if model.quantization == "fp8" and not all(found.shards[n].own_tiles for n in names if n in found.shards):
        return "a 128x128 tile would mix two shards' rows: requantized whole on the general path"
    return None


def write(model: nn.Module, named_tensors, device, commit=copy_in_place) -> None:
    """Write validated (checkpoint name, tensor) pairs into ``model`` (which ``why_not``
    and ``update_reason`` cleared), quantized tensors straight into their rows of
    ``qweight`` / ``weight_scale``, the rest through ``commit`` (the commit step).

    The pairs were validated by the caller (names, shapes, dtypes: ``validate_tensors``);
    what this path assumes is checked again here. Raises ``UpdateError`` before any write:
    a fused layer missing a shard, a shape other than the shard's rows, or NaN or inf in a
    quantized tensor (naming its layer). Tensors may be on another device or in another
    float dtype: like the staging copy, each is converted to the layer's checkpoint dtype
    on the layer's device first.
    """
    found = plan(model)
    pairs = list(named_tensors)
    mine = [(found.shards[n], t) for n, t in pairs if n in found.shards]
    rest = [(n, t) for n, t in pairs if n not in found.shards]
    arrived: dict[str, set] = {}
    for s, _ in mine:
        arrived.setdefault(s.layer, set()).add(s.shard_id)
    for layer, ids in arrived.items():
        missing = [sid for sid in found.layers[layer].shard_ids if sid not in ids]
        if missing:
            raise UpdateError(f"{layer}: received shards {sorted(map(str, ids))} but not "
                              f"{[str(sid) for sid in missing]}; a quantized fused layer is requantized "
                              f"whole, so an update must send all of its shards")
    for s, t in mine:
        if tuple(t.shape) != (s.rows, s.module.in_features) or not t.is_floating_point():
            raise UpdateError(f"{s.name}: a {t.dtype} tensor of shape {tuple(t.shape)}, expected a "
                              f"floating-point one of shape {(s.rows, s.module.in_features)}")
    if mine:
        _write(model.quantization, [(s, _prepared(s, t)) for s, t in mine])
    if rest:
        commit(model, rest, device)  # after the check: a refused update writes nothing


def apply(model: nn.Module, named_tensors, device, allow_pending: bool = False) -> bool:
    """Both questions and the write in one call, for code outside an engine: True when
    written, False when this update is the general path's (nothing written then)."""
    pairs = list(named_tensors)
    if why_not(model) is not None or update_reason(model, [n for n, _ in pairs], allow_pending) is not None:
        return False
    write(model, pairs, device)
    return True


def _prepared(s: Shard, t: torch.Tensor) -> torch.Tensor:
    """``t`` as the general path's staging tensor would hold it: the checkpoint dtype of
    the layer (its meta ``weight`` shell) on the kernel tensors' device, rows contiguous."""
    w = t.to(device=s.module.qweight.device, dtype=s.module.weight.dtype, non_blocking=True)
    return w if w.stride(-1) == 1 else w.contiguous()


def _scale_rows(kind: str, s: Shard) -> torch.Tensor:
    """The rows of the live ``weight_scale`` that shard ``s`` owns (a view: writing it writes the layer's)."""
    if kind == "int8":
        return s.module.weight_scale.narrow(0, s.first, s.rows)
    return s.module.weight_scale.narrow(0, s.first // quant.FP8_BLOCK, -(-s.rows // quant.FP8_BLOCK))


def _refuse(shards, bad) -> None:
    s = next(s for (s, _), b in zip(shards, bad) if b)
    raise UpdateError(f"{s.layer}: the weight holds NaN or infinite values (checkpoint tensor {s.name}); "
                      f"the update was refused before any weight changed")


def _write(kind: str, shards: list[tuple[Shard, torch.Tensor]]) -> None:
    w, quantizer = shards[0][1], QUANTIZERS[kind][1]
    if (fused_quant.triton is not None and all(fused_quant.available(x) for _, x in shards)
            and fused_quant.agrees_with(kind, getattr(quant, quantizer), w.device, w.dtype)):
        _write_fused(kind, shards)
    else:
        _write_reference(kind, getattr(quant, quantizer), shards)


def _write_fused(kind: str, shards) -> None:
    """GPU: pass 1 over every shard in one launch into one scale and one count buffer, the
    one check, then pass 2 over every shard in one launch straight into its ``qweight``
    rows, and the scales copied in. (A launch per shard kept the GPU waiting for the CPU:
    at ~8B about 250 shards; measured 23% of a device copy for FP8 that way, 29% so.)"""
    ws = [w for _, w in shards]
    shapes = [fused_quant.scale_shape(kind, w) for w in ws]
    sizes = [torch.Size(shape).numel() for shape in shapes]
    scales = torch.empty(sum(sizes), dtype=torch.float32, device=ws[0].device)
    bad = torch.empty(sum(sizes), dtype=torch.int32, device=ws[0].device)
    fused_quant.scales_pass(kind, ws, scales, bad)
    if bool(bad.any()):  # the one synchronization of the update
        _refuse(shards, [bool(count.any()) for count in bad.split(sizes)])
    fused_quant.quant_pass(kind, ws, [s.module.qweight.narrow(0, s.first, s.rows) for s, _ in shards], scales)
    torch._foreach_copy_([_scale_rows(kind, s) for s, _ in shards],
                         [scale.view(shape) for scale, shape in zip(scales.split(sizes), shapes)])


def _write_reference(kind: str, quantize, shards) -> None:
    """CPU (or a GPU without agreeing kernels): every tensor checked first (its largest
    magnitude, NaN and inf propagate into it; one synchronization), then the reference
    quantizer on each shard and its result copied into the shard's rows."""
    peaks = torch.stack([torch.linalg.vector_norm(w, float("inf")).float() for _, w in shards])
    finite = torch.isfinite(peaks)
    if not bool(finite.all()):
        _refuse(shards, (~finite).tolist())
    for s, w in shards:
        q, scale = quantize(w)
        s.module.qweight.narrow(0, s.first, s.rows).copy_(q)
        _scale_rows(kind, s).copy_(scale)
