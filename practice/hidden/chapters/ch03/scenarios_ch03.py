"""Chapter 03 scenarios for the differential cases (``test_differential.py``): plain functions
of JSON-able arguments, run on the learner's ``course_lib`` and on the reference's (see
``twin.py``); each builds its weights and layers from a seed and returns what it observed,
as JSON. Everything runs on the CPU, where both editions compute bit for bit alike, so
values are compared by their bytes.
"""
from __future__ import annotations

import gc
import weakref

import torch

from engine_scenarios import tensor_digest as digest, error_kind

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def weight(shape: list, dtype: str, layout: str, special: str, seed: int) -> torch.Tensor:
    """A random weight of ``shape`` from ``seed``, maybe with a special row or value.

    ``layout``: "contiguous" or "transposed" (a non-contiguous view). ``special``: "none",
    "zero_row" (a row of zeros), "ties" (a row whose largest magnitude is 127 and whose
    other values sit exactly halfway between integers), "small" (values near 1e-30),
    "large" (values near 1e30), "nan", "inf", "-inf" (one such value)."""
    gen = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    w = torch.randn(shape, generator=gen, dtype=torch.float64) * 3
    if special == "small":
        w = w * 1e-30
    elif special == "large":
        w = w * 1e30
    if w.dim() == 2 and w.shape[0] and w.shape[1]:
        r = int(torch.randint(w.shape[0], (1,), generator=gen))
        c = int(torch.randint(w.shape[1], (1,), generator=gen))
        if special == "zero_row":
            w[r] = 0
        elif special == "ties":
            halves = torch.randint(-126, 126, (w.shape[1],), generator=gen).double() + 0.5
            halves[c] = 127.0 if c % 2 else -127.0
            w[r] = halves
        elif special in ("nan", "inf", "-inf"):
            w[r, c] = float(special)
    elif special in ("nan", "inf", "-inf") and n:
        w.view(-1)[0] = float(special)
    w = w.to(DTYPES[dtype])
    if layout == "transposed" and w.dim() == 2:
        w = w.t().contiguous().t()
    return w


def _tensor_obs(t, w, contiguity: bool) -> dict:
    if not isinstance(t, torch.Tensor):
        return {"type": type(t).__name__}
    out = {"shape": list(t.shape), "dtype": str(t.dtype), "device": str(t.device), "bytes": digest(t),
           "shares_the_weight_storage": t.numel() > 0 and w.numel() > 0
           and t.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()}
    if contiguity:  # only where the contract promises it (FP8's q; int8's q may follow w's layout)
        out["contiguous"] = t.is_contiguous()
    return out


def quantize(which: str, shape: list, dtype: str, layout: str, special: str, seed: int, block: int | None = None) -> dict:
    """Quantize one weight: q and scale (shape, dtype, device, contiguity, bytes, whether
    either shares the weight's memory), or which error; and the weight afterwards."""
    from course_lib.layers import quant
    torch.set_num_threads(1)
    w = weight(shape, dtype, layout, special, seed)
    before = digest(w)
    try:
        if which == "int8":
            got = quant.quantize_int8_per_channel(w)
        else:
            got = quant.quantize_fp8_block(w) if block is None else quant.quantize_fp8_block(w, block)
    except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
        out = {"raised": error_kind(exc)}
    else:
        if isinstance(got, tuple) and len(got) == 2:
            out = {"q": _tensor_obs(got[0], w, which == "fp8"), "scale": _tensor_obs(got[1], w, False)}
        else:
            out = {"returned": type(got).__name__}
    out["weight_unchanged"] = digest(w) == before
    return out


# ---- exercise 3: the requantization pass ----------------------------------------------------

def _own_quantize(method, calls: list, watch):
    """A stand-in quantizer (so these cases do not depend on exercises 1 and 2): integers and
    scales that depend on every value of the weight, of the kernel tensors' shapes; ValueError
    for a non-finite weight (the contract's one refusal). ``watch()`` runs first, on every call."""
    from course_lib.layers.quant import Int8PerChannel

    def q(w):
        watch()
        calls.append(1)
        w = w.float()
        if not torch.isfinite(w).all():
            raise ValueError("the weight holds NaN or infinite values")
        ints = (w * 7).round().clamp(-100, 100)
        out, inn = w.shape
        shape = method.scale_shape(out, inn)
        scale = torch.full(shape, float(w.abs().sum()) + 1.0) + torch.arange(
            int(torch.tensor(shape).prod()), dtype=torch.float32).view(shape)
        return ints.to(torch.int8 if isinstance(method, Int8PerChannel) else torch.float8_e4m3fn), scale.float()
    return q


def _pass_layers(method: str, kinds: list, dtype):
    """A module holding one quantized linear layer per ``kinds`` entry [kind, rows, in]
    ("plain": one shard; "merged": gate and up of ``rows`` each; "qkv": q of 2 * ``rows``,
    k and v of ``rows``), named l0, l1, ..., sharing one quant method."""
    from torch import nn
    from course_lib.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear
    from course_lib.layers.quant import Fp8Block, Int8PerChannel
    m = Int8PerChannel() if method == "int8" else Fp8Block()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layers = []
        for kind, rows, inn in kinds:
            if kind == "plain":
                layers.append(ColumnParallelLinear(inn, rows, quant_method=m))
            elif kind == "merged":
                layers.append(MergedColumnParallelLinear(inn, [rows, rows], quant_method=m))
            else:
                layers.append(QKVParallelLinear(inn, 1, 2 * rows, rows, quant_method=m))
    finally:
        torch.set_default_dtype(prev)
    holder = nn.Module()
    for i, layer in enumerate(layers):
        holder.add_module(f"l{i}", layer)
    return holder, m


def _stage_round(layer, spec, gen, kept):
    """Stage the shards of ``spec`` ([shard index, ...], "float" | "nan") into ``layer`` as its
    loaders would: its staging tensor (made by the first shard since the last pass), each
    shard's rows filled, its id recorded. ``kept`` gets a weak reference to a new staging tensor."""
    shards, how = spec
    ids = [layer.shard_ids[i % len(layer.shard_ids)] for i in shards]
    if not ids:
        return
    if layer.staging is None:
        layer.staging = torch.randn(layer.weight.shape, generator=gen).to(layer.weight.dtype)
        kept.append(weakref.ref(layer.staging))
    for sid in ids:
        first, rows = layer.shard_rows(sid)
        layer.staging[first:first + rows] = torch.randn(rows, layer.staging.shape[1], generator=gen)
        layer.staged_shards.add(sid)
    if how == "nan":
        first, rows = layer.shard_rows(ids[0])
        layer.staging[first + int(torch.randint(rows, (1,), generator=gen)), 0] = float("nan")


def requantize(method: str, kinds: list, rounds: list, allow_pending: list, dtype: str, seed: int) -> list:
    """Rounds of an update on layers ``kinds`` (see ``_pass_layers``): in each, stage per
    layer ``rounds[r][i]`` ([shard indices], "float" | "nan"; no shards: nothing for that
    layer), then run the model's requantization (``process_weights_after_loading`` with
    ``allow_pending[r]``, None: left out). After each: what it returned or which error; per layer the kernel
    tensors' bytes, whether they changed and are still the same objects at the same
    addresses, the staged weight left (its bytes) and the shard ids; how many staged floats
    of this round are still alive; whether every quantizer call found the staged weights
    alive plus the results returned so far within what the staged weights took at the
    start; how many quantizer calls (when it returned)."""
    from course_lib.layers import quant
    torch.set_num_threads(1)
    holder, m = _pass_layers(method, kinds, DTYPES[dtype])
    layers = [getattr(holder, f"l{i}") for i in range(len(kinds))]
    objects = [(layer.qweight, layer.weight_scale, layer.qweight.data_ptr(), layer.weight_scale.data_ptr())
               for layer in layers]
    gen = torch.Generator().manual_seed(seed)
    trace = []
    for r, specs in enumerate(rounds):
        kept, calls, results, over = [], [], [], []
        for layer, spec in zip(layers, specs):
            _stage_round(layer, spec, gen, kept)
        staged = [(weakref.ref(t.staging), t.staging.numel() * t.staging.element_size())
                  for t in layers if t.staging is not None]
        budget = sum(n for _, n in staged)

        def watch():
            alive = sum(n for ref, n in staged if ref() is not None) + sum(n for ref, n in results if ref() is not None)
            over.append(alive > budget)
        own = _own_quantize(m, calls, watch)

        def quantize(w):
            q, scale = own(w)
            results.extend((weakref.ref(t), t.numel() * t.element_size()) for t in (q, scale))
            return q, scale
        m.quantize = quantize
        before = [(digest(t.qweight), digest(t.weight_scale)) for t in layers]
        try:
            pending = allow_pending[r % len(allow_pending)]  # None: the argument left out (its default)
            got = (quant.process_weights_after_loading(holder) if pending is None
                   else quant.process_weights_after_loading(holder, allow_pending=pending))
            entry = {"returned": got if isinstance(got, list) else repr(got), "quantize_calls": len(calls)}
        except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
            entry = {"raised": error_kind(exc)}
        del m.quantize
        gc.collect()
        entry["layers"] = [_layer_after(t, b, o) for t, b, o in zip(layers, before, objects)]
        entry["staged_floats_alive"] = sum(1 for ref in kept if ref() is not None)
        entry["within_memory"] = not any(over)
        trace.append(entry)
    return trace


def _layer_after(layer, before, objects) -> dict:
    q, s = digest(layer.qweight), digest(layer.weight_scale)
    st = getattr(layer, "staging", None)
    ss = getattr(layer, "staged_shards", None)
    return {"qweight": q, "weight_scale": s, "changed": [q != before[0], s != before[1]],
            "same_objects": layer.qweight is objects[0] and layer.weight_scale is objects[1],
            "same_addresses": layer.qweight.data_ptr() == objects[2] and layer.weight_scale.data_ptr() == objects[3],
            "buffers": sorted(n for n, _ in layer.named_buffers()),
            "staging": digest(st) if isinstance(st, torch.Tensor) else repr(st),
            "staged_shards": sorted(map(str, ss)) if isinstance(ss, (set, list, tuple)) else repr(ss),
            "staged_shards_is_a_set": isinstance(ss, set)}


# ---- exercise 4: the layer-by-layer reload ----------------------------------------------------
#
# A real engine's model (a tiny config, maybe quantized) and a new checkpoint's tensors, from a
# seed; a LayerwiseReload expecting some of its names is fed a drawn sequence of tensors (layers
# interleaved, names refused, one fed twice, a NaN layer, an update that stops short). The
# reload's ``_transfer`` and ``_apply`` (the calls the contract names) are wrapped on the
# instance to count and log them; the real ones run.

_LAYERWISE_CONFIGS = [dict(hidden_size=48, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=16, num_hidden_layers=2, tie_word_embeddings=False),
                      dict(hidden_size=64, intermediate_size=200, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, num_hidden_layers=3, tie_word_embeddings=True),
                      dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1,
                           head_dim=32, num_hidden_layers=1, tie_word_embeddings=False)]
_LAYERWISE_CHECKPOINTS: dict = {}
_LAYERWISE_TMP = []


def _layerwise_checkpoint(config_index: int, seed: int):
    import tempfile
    from course_lib.weights.checkpoint import preset, random_state_dict, write_checkpoint
    if not _LAYERWISE_TMP:
        _LAYERWISE_TMP.append(tempfile.TemporaryDirectory(prefix="ch03-layerwise-"))
    key = (config_index, seed)
    if key not in _LAYERWISE_CHECKPOINTS:
        config = preset("tiny", **_LAYERWISE_CONFIGS[config_index])
        _LAYERWISE_CHECKPOINTS[key] = (config, write_checkpoint(f"{_LAYERWISE_TMP[0].name}/c{config_index}-{seed}",
                                                                config, random_state_dict(config, seed)))
    return _LAYERWISE_CHECKPOINTS[key]


def _layer_digests(model) -> dict:
    """One digest per layer of everything the kernels read (parameters and buffers)."""
    from course_lib.weights.commit.layerwise import layer_key
    import hashlib
    per = {}
    for name, t in sorted(list(model.named_parameters()) + list(model.named_buffers())):
        if t.device.type == "meta":
            continue
        per.setdefault(layer_key(name) if name.startswith("model.layers.") else name, []).append(
            f"{name}={digest(t)}")
    return {k: hashlib.sha256(";".join(v).encode()).hexdigest()[:16] for k, v in per.items()}


def _waiting(pairs, is_fed):
    """A layer's buffer as the contract shapes it, a list of (name, tensor) pairs: per pair
    (sorted by name: the order is free) its name, bytes, dtype, device and whether it is the
    very tensor fed; anything else by type."""
    if not isinstance(pairs, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[1], torch.Tensor) for p in pairs):
        return f"not a list of (name, tensor) pairs: {type(pairs).__name__}"
    return sorted([str(n), digest(b), str(b.dtype), str(b.device), is_fed(n, b)] for n, b in pairs)


def _feed_plan(bring: list, order: str, faults: list, stop_short: int, gen) -> list:
    """[kind, name] in the order fed: every name the update brings once, ordered by ``order``
    ("layers": layer after layer, in a random layer order, the names of each in a random
    order; "interleaved": the same with a few tensors fed early, before their layer's turn;
    "shuffled": any order), then ``faults`` [kind, at, index]: "unknown" and "twice" insert a
    name the update does not bring (``index`` into those) or one it brings a second time at
    position ``at``; "nan" puts a NaN into the tensor of the ``index``-th name; the last
    ``stop_short`` are left out."""
    from course_lib.weights.commit.layerwise import layer_key

    def perm(n):
        return torch.randperm(n, generator=gen).tolist()
    groups = {}
    for n in bring:
        groups.setdefault(layer_key(n), []).append(n)
    keys = list(groups)
    plan = [["feed", n] for k in (keys[i] for i in perm(len(keys))) for n in (groups[k][j] for j in perm(len(groups[k])))]
    if order == "shuffled":
        plan = [plan[i] for i in perm(len(plan))]
    elif order == "interleaved" and len(plan) > 2:
        for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
            a = int(torch.randint(1, len(plan), (1,), generator=gen))
            b = int(torch.randint(0, a, (1,), generator=gen))
            plan.insert(b, plan.pop(a))  # fed early, before the layers in between
    for kind, at, index in faults:
        if kind == "nan" and bring:
            target = bring[index % len(bring)]
            plan = [["nan", n] if n == target and k == "feed" else [k, n] for k, n in plan]
        elif kind == "twice" and bring:
            plan.insert(at % (len(plan) + 1), ["twice", bring[index % len(bring)]])
        elif kind == "unknown":
            plan.insert(at % (len(plan) + 1), ["unknown", index])
    return plan[:len(plan) - stop_short] if stop_short else plan


def layerwise(config: int, quantization, seed: int, bring_layers: list, drop_names: list, order: str,
              faults: list, stop_short: int = 0, layout: str = "contiguous", dtype: str = "as_checkpoint",
              check_finite: bool | None = True, device: str = "cpu") -> list:
    """Feed a LayerwiseReload on a tiny model (``config``: an index into the configs above;
    ``quantization``: None, "int8" or "fp8"). The update brings the new checkpoint's layers
    ``bring_layers`` (indices into its layers in order; empty: every layer) less the names
    ``drop_names`` (indices; unquantized models only: a quantized fused layer is requantized
    whole, so its update brings all its shards), fed as ``_feed_plan`` says. ``layout``:
    "contiguous" or "transposed" (2-D tensors fed as non-contiguous views); ``dtype``:
    "as_checkpoint" or a float dtype the tensors are fed in; ``check_finite``: the reload's
    option (None: left out).
    After each feed: what it returned or which error; which layers of the model changed;
    held and peak bytes; the buffers ({layer: [[name, bytes digest, dtype, device, whether
    it is the very tensor fed]]}, layers with tensors waiting); the layers applied; how many
    transfers and applies so far, and what each apply was given (names, bytes, whether the
    very tensors fed); how many fed tensors are still alive, and their bytes. At the end
    (unless a layer's write failed): what ``finish`` returns or which error, and every
    layer's digest. Once a tensor holding NaN has been fed (with ``check_finite``) the
    contract lets the refusal come then or when its layer completes: the trace then ends
    with one summary (refused or not; whether that layer was written)."""
    from course_lib import Engine
    from course_lib.weights.checkpoint import random_state_dict
    from course_lib.weights.commit.layerwise import LayerwiseReload, layer_key
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(seed)
    cfg, path = _layerwise_checkpoint(config, seed % 2)
    engine = Engine(path, quantization=quantization, device=device)
    model = engine.model
    new = random_state_dict(cfg, 1000 + seed)
    keys = list(dict.fromkeys(layer_key(n) for n in new))
    chosen = {keys[i % len(keys)] for i in bring_layers} if bring_layers else set(keys)
    bring = [n for n in new if layer_key(n) in chosen]
    if quantization is None and drop_names and bring:
        dropped = {bring[i % len(bring)] for i in drop_names}
        bring = [n for n in bring if n not in dropped]
    others = [n for n in new if n not in bring] + ["model.layers.0.mlp.extra_proj.weight",
                                                   "model.layers.99.mlp.up_proj.weight", "model.unknown.weight"]
    plan = _feed_plan(bring, order, faults, stop_short, gen)
    option = {} if check_finite is None else {"check_finite": check_finite}  # None: left out (its default)
    reload = LayerwiseReload(model, list(bring), device, **option)
    check_finite = check_finite is not False
    fed_names = {n for k, n in plan if k in ("feed", "nan")}
    completes = {key for key in {layer_key(n) for n in bring} if all(n in fed_names for n in bring if layer_key(n) == key)}
    watched = _Watched(reload, model, completes)
    trace = []
    for kind, name in plan:
        if kind == "unknown":
            name = others[name % len(others)]
            base = new.get(name, new[bring[0]] if bring else torch.zeros(2, 2))
        else:
            base = new[name]
        t = base.clone() if dtype == "as_checkpoint" else base.to(DTYPES[dtype])
        if kind == "nan" and t.numel():
            t.view(-1)[int(torch.randint(t.numel(), (1,), generator=gen))] = float("nan")
        if layout == "transposed" and t.dim() == 2:
            t = t.t().contiguous().t()
        entry = watched.feed(kind, name, t, nan_refusal_open=check_finite)
        del t
        if entry is None:
            continue  # after a NaN was fed: only the summary is compared
        trace.append(entry)
        if entry.get("stop"):
            return trace
    if watched.nan_key is not None and check_finite:
        trace.append(watched.nan_summary(refused=False))
        return trace
    trace.append(watched.end())
    return trace


class _Watched:
    """A LayerwiseReload fed and watched: its ``_transfer`` and ``_apply`` (the calls the
    contract names) wrapped on the instance to count and log them; the real ones run."""

    def __init__(self, reload, model, completes: set):
        self.reload, self.model, self.completes = reload, model, completes
        self.start = _layer_digests(model)
        self.transfers, self.applies, self.alive, self.fed = [0], [], [], {}
        self.nan_key = None
        real_transfer, real_apply = reload._transfer, reload._apply

        def counted_transfer(tensor):
            self.transfers[0] += 1
            return real_transfer(tensor)

        def logged_apply(key, tensors):
            self.applies.append([key, sorted([str(n), digest(t), self.is_fed(n, t)] for n, t in tensors)])
            return real_apply(key, tensors)
        reload._transfer, reload._apply = counted_transfer, logged_apply

    def is_fed(self, name, t):
        return any(r() is t for r in self.fed.get(name, ()))

    def changed(self):
        now = _layer_digests(self.model)
        return sorted(k for k in now if now[k] != self.start.get(k))

    def feed(self, kind, name, t, nan_refusal_open: bool):
        from course_lib.weights.commit.layerwise import layer_key
        self.fed.setdefault(name, []).append(weakref.ref(t))
        self.alive.append((weakref.ref(t), t.numel() * t.element_size()))
        if kind == "nan" and nan_refusal_open and self.nan_key is None:
            self.nan_key = layer_key(name)
        try:
            entry = {"op": [kind, name], "returned": repr(self.reload.feed(name, t))}
        except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
            entry = {"op": [kind, name], "raised": error_kind(exc)}
        gc.collect(0)  # a young cycle (a traceback's frames) holds no tensor past this point
        if self.nan_key is not None:
            if "raised" in entry and kind in ("nan", "feed"):
                return self.nan_summary(refused=entry["raised"])
            return None
        entry["layers_changed"] = self.changed()
        if "raised" in entry and self.applies and self.applies[-1][0] not in self.reload.applied:
            entry["stop"] = True  # what the reload holds after a failed write is left free by the contract
            return entry
        r = self.reload
        entry.update(
            held_bytes=r.held_bytes, peak_held_bytes=r.peak_held_bytes,
            buffers={str(k): _waiting(v, self.is_fed) for k, v in sorted(r.buffers.items()) if v},
            applied=list(r.applied), transfers=self.transfers[0], applies=self.applies[:],
            fed_alive=sum(1 for ref, _ in self.alive if ref() is not None),
            fed_alive_bytes=sum(n for ref, n in self.alive if ref() is not None))
        return entry

    def nan_summary(self, refused) -> dict:
        """Refused (the error's type) or not, where the plan completes the NaN's layer (else
        the refusal may come or not); whether that layer was written."""
        said = refused if self.nan_key in self.completes else "free: its layer never completes"
        return {"after_nan": {"refused": said, "nan_layer_written": self.nan_key in self.changed()}, "stop": True}

    def end(self) -> dict:
        try:
            stats = self.reload.finish()
            end = {"finish": {k: v for k, v in stats.items() if k != "gpu_peak_extra_bytes"}}
            if "gpu_peak_extra_bytes" in stats:  # the allocator's figure: compared within a bound by the test
                end["gpu_peak_extra_bytes"] = stats["gpu_peak_extra_bytes"]
        except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
            end = {"finish_raised": error_kind(exc)}
        end["layers"] = _layer_digests(self.model)
        return end
