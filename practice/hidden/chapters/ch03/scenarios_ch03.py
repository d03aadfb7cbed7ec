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

from engine_scenarios import tensor_digest as digest

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
        out = {"raised": type(exc).__name__}
    else:
        if isinstance(got, tuple) and len(got) == 2:
            out = {"q": _tensor_obs(got[0], w, which == "fp8"), "scale": _tensor_obs(got[1], w, False)}
        else:
            out = {"returned": type(got).__name__}
    out["weight_unchanged"] = digest(w) == before
    return out


# ---- exercise 3: requantize in place --------------------------------------------------------

def _own_quantize(method, fail_on_nan: bool):
    """A stand-in quantizer (so this case does not depend on exercises 1 and 4): integers
    and scales that depend on every value of the weight, of the kernel tensors' shapes."""
    from course_lib.layers.quant import Int8PerChannel

    def q(w):
        w = w.float()
        if fail_on_nan and not torch.isfinite(w).all():
            raise ValueError("the weight holds NaN or infinite values")
        ints = (w * 7).round().clamp(-100, 100)
        out, inn = w.shape
        shape = method.scale_shape(out, inn)
        scale = torch.full(shape, float(w.abs().sum()) + 1.0) + torch.arange(
            int(torch.tensor(shape).prod()), dtype=torch.float32).view(shape)
        return ints.to(torch.int8 if isinstance(method, Int8PerChannel) else torch.float8_e4m3fn), scale.float()
    return q


def requantize(method: str, out_features: int, in_features: int, staged: str, shards: list, seed: int,
               rounds: int = 1) -> list:
    """``rounds`` times: stage a weight (``staged``: "float", "nan" or "none"), process the
    layer. After each: what it returned or which error; the kernel tensors' bytes, shape,
    dtype, whether they are the same objects at the same addresses as at creation, whether
    they changed; the staging and staged shards left; the staged tensor unchanged, and
    whether anything still holds it once processed."""
    from course_lib.layers.linear import ColumnParallelLinear
    from course_lib.layers.quant import Fp8Block, Int8PerChannel
    torch.set_num_threads(1)
    m = Int8PerChannel() if method == "int8" else Fp8Block()
    m.quantize = _own_quantize(m, fail_on_nan=True)
    layer = ColumnParallelLinear(in_features, out_features, quant_method=m)
    qweight, scale = layer.qweight, layer.weight_scale
    q_ptr, s_ptr = qweight.data_ptr(), scale.data_ptr()
    gen = torch.Generator().manual_seed(seed)
    trace = []
    for _ in range(rounds):
        w = None
        if staged != "none":
            w = torch.randn(out_features, in_features, generator=gen)
            if staged == "nan" and w.numel():
                w.view(-1)[int(torch.randint(w.numel(), (1,), generator=gen))] = float("nan")
            layer.staging, layer.staged_shards = w, set(shards)
        w_before = None if w is None else digest(w)
        q_before, s_before = digest(layer.qweight), digest(layer.weight_scale)
        try:
            entry = {"returned": repr(m.process_weights_after_loading(layer))}
        except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
            entry = {"raised": type(exc).__name__}
        kernel = {"qweight": layer.qweight, "weight_scale": layer.weight_scale}
        entry.update(
            qweight=digest(layer.qweight), weight_scale=digest(layer.weight_scale),
            qweight_changed=digest(layer.qweight) != q_before, scale_changed=digest(layer.weight_scale) != s_before,
            same_objects=layer.qweight is qweight and layer.weight_scale is scale,
            same_addresses=layer.qweight.data_ptr() == q_ptr and layer.weight_scale.data_ptr() == s_ptr,
            buffers=sorted(n for n, _ in layer.named_buffers()),
            kinds={n: [str(t.dtype), list(t.shape)] for n, t in kernel.items()},
            staged_tensor_unchanged=w is None or digest(w) == w_before)
        kept = None if w is None else weakref.ref(w)
        del w
        gc.collect()
        if "returned" in entry:
            # No float copy of the weight survives the processing, under any name.
            entry["float_weight_still_alive"] = kept is not None and kept() is not None
            ss = getattr(layer, "staged_shards", None)
            entry.update(staging_left=getattr(layer, "staging", None) is not None,
                         staged_shards_left=sorted(map(str, ss)) if isinstance(ss, (set, list, tuple)) else repr(ss),
                         staged_shards_is_a_set=isinstance(ss, set))
        trace.append(entry)
    return trace


# ---- exercise 2: stage each shard -----------------------------------------------------------

def _layer(kind, sizes, hidden, tp_size, rank, method):
    from course_lib.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear
    from course_lib.layers.quant import Fp8Block, Int8PerChannel
    m = Int8PerChannel() if method == "int8" else Fp8Block()
    if kind == "plain":
        return ColumnParallelLinear(hidden, sizes[0], tp_rank=rank, tp_size=tp_size, quant_method=m)
    if kind == "merged":
        return MergedColumnParallelLinear(hidden, list(sizes), tp_rank=rank, tp_size=tp_size, quant_method=m)
    return QKVParallelLinear(hidden, 2, sizes[0], sizes[1], tp_rank=rank, tp_size=tp_size, quant_method=m)


def _full_rows(kind, sizes, shard_id):
    if kind == "plain":
        return sizes[0]
    if kind == "merged":
        return sizes[shard_id]
    return (sizes[0] if shard_id == "q" else sizes[1]) * 2


def _own_rows(kind, sizes, tp_size, shard_id):
    """Where a shard lands in a rank's weight, worked out here."""
    if kind == "plain":
        return 0, sizes[0] // tp_size
    if kind == "merged":
        return sum(s // tp_size for s in sizes[:shard_id]), sizes[shard_id] // tp_size
    qr, kr = sizes[0] // tp_size * 2, sizes[1] // tp_size * 2
    return {"q": (0, qr), "k": (qr, kr), "v": (qr + kr, kr)}[shard_id]


def stage(kind: str, sizes: list, hidden: int, tp_size: int, rank: int, method: str, dtype: str, param_name,
          shards: list, seed: int) -> list:
    """Feed shards to a quantized layer's weight shell, through ``shards`` = [[shard id,
    "weight_loader" | "local_loader", "right" | "wrong_shape"], ...]. After each: what the
    loader returned or which error; the staging tensor (exists, shape, dtype, device, its
    ``param_name``, whether it is the same tensor as after the first shard, the bytes of
    the rows the shards fed so far); the staged shard ids; the kernel tensors unchanged."""
    torch.set_num_threads(1)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[dtype])
    try:
        layer = _layer(kind, sizes, hidden, tp_size, rank, method)
    finally:
        torch.set_default_dtype(prev)
    if param_name is not None:
        layer.weight.param_name = param_name
    shell = layer.weight
    gen = torch.Generator().manual_seed(seed)
    q0, s0 = digest(layer.qweight), digest(layer.weight_scale)
    first, fed, trace = None, [], []
    for shard_id, through, how in shards:
        sid = None if kind == "plain" else shard_id
        full = torch.randn(_full_rows(kind, sizes, sid), hidden, generator=gen) * 5
        if through == "weight_loader":
            loaded = full if how == "right" else full[:, :-1] if hidden > 1 else full[:0]
        else:
            rows = full.shape[0] // tp_size
            loaded = full[rank * rows:(rank + 1) * rows]
            loaded = loaded if how == "right" else torch.cat([loaded, loaded[:1]])
        loaded_before = digest(loaded)
        loader = getattr(shell, through)
        try:
            entry = {"returned": repr(loader(shell, loaded) if sid is None else loader(shell, loaded, sid))}
            if how == "right":
                fed.append(sid)
        except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
            entry = {"raised": type(exc).__name__}
        st = getattr(layer, "staging", None)
        if isinstance(st, torch.Tensor):
            if first is None:
                first = st
            written = {}
            for f in dict.fromkeys(fed):
                a, n = _own_rows(kind, sizes, tp_size, f)
                written[str(f)] = digest(st[a:a + n])
            entry["staging"] = {"shape": list(st.shape), "dtype": str(st.dtype), "device": str(st.device),
                                "param_name": getattr(st, "param_name", "<none>"), "same_tensor": st is first,
                                "rows_fed": written, "is_the_shell": st is shell}
        else:
            entry["staging"] = repr(st)
        ss = getattr(layer, "staged_shards", None)
        entry["staged_shards"] = sorted(map(str, ss)) if isinstance(ss, (set, list, tuple)) else repr(ss)
        entry["kernel_unchanged"] = digest(layer.qweight) == q0 and digest(layer.weight_scale) == s0
        entry["shell_is_the_weight"] = layer.weight is shell and shell.device.type == "meta"
        entry["loaded_unchanged"] = digest(loaded) == loaded_before
        trace.append(entry)
    return trace


# ---- exercise 5: the layer-by-layer buffer ----------------------------------------------------
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
    its name, bytes, dtype, device and whether it is the very tensor fed; anything else by type."""
    if not isinstance(pairs, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[1], torch.Tensor) for p in pairs):
        return f"not a list of (name, tensor) pairs: {type(pairs).__name__}"
    return [[str(n), digest(b), str(b.dtype), str(b.device), is_fed(n, b)] for n, b in pairs]


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
              device: str = "cpu") -> list:
    """Feed a LayerwiseReload on a tiny model (``config``: an index into the configs above;
    ``quantization``: None, "int8" or "fp8"). The update brings the new checkpoint's layers
    ``bring_layers`` (indices into its layers in order; empty: every layer) less the names
    ``drop_names`` (indices; unquantized models only: a quantized fused layer is requantized
    whole, so its update brings all its shards), fed as ``_feed_plan`` says. ``layout``:
    "contiguous" or "transposed" (2-D tensors fed as non-contiguous views); ``dtype``:
    "as_checkpoint" or a float dtype the tensors are fed in.
    After each feed: what it returned or which error; which layers of the model changed;
    held and peak bytes; the buffers ({layer: [[name, bytes digest, dtype, device, whether
    it is the very tensor fed]]}, layers with tensors waiting); the names still to come; the
    layers applied; how many transfers and applies so far, and what each apply was given
    (names, bytes, whether the very tensors fed); how many fed tensors are still alive, and
    their bytes. At the end (unless a layer's write failed): what ``finish`` returns or which
    error, and every layer's digest."""
    import weakref
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
    start = _layer_digests(model)
    reload = LayerwiseReload(model, list(bring), device)
    transfers, applies = [0], []
    real_transfer, real_apply = reload._transfer, reload._apply
    fed = {}  # name: weak references to the tensors fed under it

    def is_fed(name, t):
        return any(r() is t for r in fed.get(name, ()))

    def counted_transfer(tensor):
        transfers[0] += 1
        return real_transfer(tensor)

    def logged_apply(key, tensors):
        applies.append([key, sorted([str(n), digest(t), is_fed(n, t)] for n, t in tensors)])
        return real_apply(key, tensors)
    reload._transfer, reload._apply = counted_transfer, logged_apply

    alive, trace, write_failed = [], [], False
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
        fed.setdefault(name, []).append(weakref.ref(t))
        alive.append((weakref.ref(t), t.numel() * t.element_size()))
        try:
            entry = {"op": [kind, name], "returned": repr(reload.feed(name, t))}
        except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
            entry = {"op": [kind, name], "raised": type(exc).__name__}
            write_failed = bool(applies) and applies[-1][0] not in reload.applied
        del t
        gc.collect(0)  # a young cycle (a traceback's frames) holds no tensor past this point
        now = _layer_digests(model)
        entry["layers_changed"] = sorted(k for k in now if now[k] != start.get(k))
        if write_failed:  # what the reload holds after a failed write is left free by the contract
            trace.append(entry)
            break
        entry.update(
            held_bytes=reload.held_bytes, peak_held_bytes=reload.peak_held_bytes,
            buffers={str(k): _waiting(v, is_fed) for k, v in sorted(reload.buffers.items()) if v},
            remaining={str(k): sorted(v) for k, v in sorted(reload.remaining.items()) if v},
            applied=list(reload.applied), transfers=transfers[0], applies=applies[:],
            fed_alive=sum(1 for r, _ in alive if r() is not None),
            fed_alive_bytes=sum(n for r, n in alive if r() is not None))
        trace.append(entry)
    if not write_failed:
        try:
            stats = reload.finish()
            end = {"finish": {k: v for k, v in stats.items() if k != "gpu_peak_extra_bytes"}}
            if "gpu_peak_extra_bytes" in stats:  # the allocator's figure: compared within a bound by the test
                end["gpu_peak_extra_bytes"] = stats["gpu_peak_extra_bytes"]
        except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
            end = {"finish_raised": type(exc).__name__}
        end["layers"] = _layer_digests(model)
        trace.append(end)
    return trace
