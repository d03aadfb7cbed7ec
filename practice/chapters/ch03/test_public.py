"""Public tests for chapter 03's exercises (run them: python practice/judge.py test ch03).

- ch03.quantize_int8: ``quantize_int8_per_channel`` in course_lib/layers/quant.py
- ch03.quantize_fp8: ``quantize_fp8_block`` in course_lib/layers/quant.py
- ch03.requantize_layers: ``requantize_staged`` in course_lib/layers/quant.py
- ch03.layerwise_buffer: ``LayerwiseReload.feed`` in course_lib/weights/commit/layerwise.py

Each test's name starts with its exercise's name, so ``-k quantize_int8`` runs one
exercise's cases. Each case says what it expected in words. Every headline promise of a
part has a case here: when they all pass, those promises hold on these inputs.
"""
import weakref

import pytest
import torch

from course_lib import Engine
from course_lib.layers.quant import (pending_layers, process_weights_after_loading, quantize_fp8_block,
                                     quantize_int8_per_channel, requantize_staged, staged_bytes)
from course_lib.weights.checkpoint.model_loader import default_dtype
from course_lib.models.qwen3 import Qwen3ForCausalLM
from course_lib.testing import assert_hot_equals_cold
from course_lib.weights.checkpoint import CheckpointReader, make_random, preset, random_state_dict
from course_lib.weights.commit.layerwise import LayerwiseReload, layer_key
from course_lib.weights.commit.validate import UpdateError

INT8 = pytest.mark.exercise("ch03.quantize_int8")
FP8 = pytest.mark.exercise("ch03.quantize_fp8")
REQUANT = pytest.mark.exercise("ch03.requantize_layers")
LAYERWISE = pytest.mark.exercise("ch03.layerwise_buffer")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("ch03")
    return make_random(d / "a", "tiny", seed=1), make_random(d / "b", "tiny", seed=2)


# ---- ch03.quantize_int8 ----------------------------------------------------------------------

@INT8
def test_quantize_int8_known_rows_with_ties_and_a_zero_row():
    w = torch.tensor([[127.0, 2.5, -2.5, 3.5, 0.5],      # max 127: scale 1, halves round to even
                      [254.0, 5.0, -3.0, 1.0, -254.0],   # max 254: scale 2, w / 2 = 127, 2.5, -1.5, 0.5, -127
                      [0.0, 0.0, 0.0, 0.0, 0.0]])        # all zeros: scale 1
    q, scale = quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32, \
        f"expected int8 values and float32 scales, got {q.dtype} and {scale.dtype}"
    assert scale.tolist() == [1.0, 2.0, 1.0], f"expected scales [1, 2, 1] (max|row| / 127, 1 for a zero row), got {scale.tolist()}"
    want = [[127, 2, -2, 4, 0], [127, 2, -2, 0, -127], [0, 0, 0, 0, 0]]
    assert q.tolist() == want, f"expected {want} (round half to even: 2.5 -> 2, -1.5 -> -2, 3.5 -> 4), got {q.tolist()}"


@INT8
def test_quantize_int8_shapes_and_error_bound_on_a_bf16_weight():
    w = torch.randn(7, 33, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    before = w.clone()
    q, scale = quantize_int8_per_channel(w)
    assert q.shape == (7, 33) and scale.shape == (7,), f"expected shapes [7, 33] and [7], got {list(q.shape)}, {list(scale.shape)}"
    assert torch.equal(w, before), "the input weight must be left as it was"
    assert q.abs().max().item() == 127, "each row's largest |value| must map to +-127"
    err = (q.float() * scale[:, None] - w.float()).abs()
    assert (err <= scale[:, None] / 2 + 1e-6).all(), "every value must be within half a step (scale / 2) of the weight"


@INT8
def test_quantize_int8_refuses_a_weight_that_is_not_2d_or_not_finite():
    with pytest.raises(ValueError):
        quantize_int8_per_channel(torch.ones(8))
    w = torch.ones(3, 4)
    w[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize_int8_per_channel(w)


# ---- ch03.quantize_fp8 -----------------------------------------------------------------------

@FP8
def test_quantize_fp8_known_tiles_to_the_bit():
    """block=2 on a 3 x 3 weight: four tiles, three of them partial. Tile (0, 0) has max 448,
    so scale 1 and its values are cast as they are (3.3 -> 3.25, e4m3's nearest; 152 lies
    halfway between 144 and 160: ties to even give 160); tile (0, 1) is [1, 3] (scale 3 / 448: 1 -> 149.3 -> 144);
    tile (1, 0) is [0.5, -0.75]; tile (1, 1) is all zero (scale 1)."""
    w = torch.tensor([[448.0, 3.3, 1.0], [-448.0, 152.0, 3.0], [0.5, -0.75, 0.0]])
    q, scale = quantize_fp8_block(w, block=2)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (3, 3) and scale.shape == (2, 2), \
        f"expected float8_e4m3fn [3, 3] and scales [2, 2], got {q.dtype} {list(q.shape)} and {list(scale.shape)}"
    want_scale = [[1.0, 3.0 / 448], [0.75 / 448, 1.0]]
    got_scale = scale.tolist()
    assert all(abs(g - e) <= 1e-7 * e for gr, er in zip(got_scale, want_scale) for g, e in zip(gr, er)), \
        f"expected tile scales {want_scale} (max|tile| / 448, 1 for an all-zero tile), got {got_scale}"
    want = [[448.0, 3.25, 144.0], [-448.0, 160.0, 448.0], [288.0, -448.0, 0.0]]
    assert q.float().tolist() == want, \
        f"expected {want} (w / scale, clamped to +-448, cast: nearest, ties to even), got {q.float().tolist()}"


@FP8
def test_quantize_fp8_unaligned_shape_gives_partial_edge_tiles():
    w = torch.randn(130, 260, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (130, 260), \
        f"expected float8_e4m3fn [130, 260], got {q.dtype} {list(q.shape)}"
    assert scale.dtype == torch.float32 and scale.shape == (2, 3), \
        f"expected float32 scales [2, 3] (ceil(130/128), ceil(260/128)), got {scale.dtype} {list(scale.shape)}"
    assert q.is_contiguous(), "qweight must be contiguous (no padding left in it)"
    for i in range(2):
        for j in range(3):
            tile = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            want = tile.abs().max().item() / 448
            assert abs(scale[i, j].item() - want) <= 1e-6 * want, \
                f"tile ({i}, {j}): expected scale max|tile| / 448 = {want:.6g}, got {scale[i, j].item():.6g}"


@FP8
def test_quantize_fp8_zero_tile_and_round_trip():
    w = torch.randn(200, 129, generator=torch.Generator().manual_seed(2))
    w[128:, 128:] = 0.0
    q, scale = quantize_fp8_block(w)
    assert scale[1, 1].item() == 1.0, f"an all-zero tile must get scale 1, got {scale[1, 1].item()}"
    back = q.float() * scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :129]
    rel = ((back - w).norm() / w.norm()).item()
    assert rel < 0.05, f"dequantized weight should be within a few percent of the original, relative error {rel:.3f}"
    assert q.float().abs().max().item() == 448, "each tile's largest |value| must map to +-448"


@FP8
def test_quantize_fp8_refuses_a_weight_that_is_not_2d_or_not_finite():
    with pytest.raises(ValueError):
        quantize_fp8_block(torch.ones(2, 3, 4))
    w = torch.ones(5, 5)
    w[0, 0] = float("inf")
    with pytest.raises(ValueError):
        quantize_fp8_block(w)


# ---- ch03.requantize_layers ------------------------------------------------------------------

def _bf16_model(quantization, seed=3):
    """A bfloat16 tiny model (quantized) and a float32 checkpoint's tensors for it."""
    with default_dtype(torch.bfloat16):
        model = Qwen3ForCausalLM(preset("tiny"), 0, 1, quantization)
    return model, random_state_dict(preset("tiny"), seed)


def _stage(model, state, names):
    """Stage checkpoint tensors through the model's own loaders (nothing is requantized)."""
    model.load_weights([(n, state[n]) for n in names])


def _kernel(model):
    return {n: (t.clone(), t.data_ptr()) for n, t in model.named_buffers() if n.endswith(("qweight", "weight_scale"))}


def _unchanged(model, before):
    now = dict(model.named_buffers())
    return [n for n, (t, _) in before.items() if not torch.equal(now[n], t)]


QKV = [f"model.layers.{{}}.self_attn.{p}_proj.weight" for p in "qkv"]


@REQUANT
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_requantize_layers_writes_each_complete_layer_in_place_and_keeps_no_float_copy(quantization):
    model, state = _bf16_model(quantization)
    names = [n.format(0) for n in QKV] + ["model.layers.1.mlp.down_proj.weight"]
    _stage(model, state, names)
    layers = {name: m for name, m in model.named_modules() if getattr(m, "staging", None) is not None}
    want = {name: m.quant_method.quantize(m.staging.clone()) for name, m in layers.items()}
    before = _kernel(model)
    done = requantize_staged(layers)
    assert done == list(layers), f"expected the names of the layers requantized, in order: {list(layers)}, got {done}"
    now = dict(model.named_buffers())
    for name, m in layers.items():
        q, scale = want[name]
        assert torch.equal(m.qweight, q) and torch.equal(m.weight_scale, scale), \
            f"{name}: qweight and weight_scale must hold the quantization of the staged weight"
        for what in ("qweight", "weight_scale"):
            assert now[f"{name}.{what}"] is getattr(m, what) and getattr(m, what).data_ptr() == before[f"{name}.{what}"][1], \
                f"{name}.{what}: written into the tensor it had (same storage): never rebind a kernel tensor"
        assert m.staging is None and not m.staged_shards, f"{name}: no float copy may be kept (staging None, no shards)"


@REQUANT
def test_requantize_layers_refuses_an_incomplete_layer_before_any_write():
    model, state = _bf16_model("int8")
    _stage(model, state, [n.format(0) for n in QKV] + [QKV[0].format(1)])  # layer 1: q alone
    before = _kernel(model)
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj"):
        process_weights_after_loading(model)
    assert not _unchanged(model, before), \
        f"a refused pass must change no kernel tensor of any layer, changed: {_unchanged(model, before)}"
    assert staged_bytes(model) == 0 and not pending_layers(model), \
        "after a refused pass every staged weight is dropped (the update failed)"


@REQUANT
def test_requantize_layers_lets_an_incomplete_layer_wait_with_allow_pending():
    model, state = _bf16_model("fp8")
    _stage(model, state, [n.format(0) for n in QKV] + [QKV[2].format(1)])  # layer 1: v alone
    waiting = model.model.layers[1].self_attn.qkv_proj
    staged, before = waiting.staging.clone(), _kernel(model)
    done = process_weights_after_loading(model, allow_pending=True)
    assert done == ["model.layers.0.self_attn.qkv_proj"], f"only the complete layer is requantized, got {done}"
    assert pending_layers(model) == {"model.layers.1.self_attn.qkv_proj": ["q", "k"]}, \
        f"layer 1 waits for q and k, staged as it was: {pending_layers(model)}"
    first, rows = waiting.shard_rows("v")
    assert torch.equal(waiting.staging[first:first + rows], staged[first:first + rows]), \
        "a waiting layer's staged rows must stay exactly as they were"
    changed = {n.rsplit(".", 1)[0] for n in _unchanged(model, before)}
    assert changed == {"model.layers.0.self_attn.qkv_proj"}, f"only layer 0's kernel tensors may change, changed: {changed}"


@REQUANT
def test_requantize_layers_a_weight_the_quantizer_refuses_changes_no_layer():
    """Layer 1's staged weight holds a NaN: the quantizer refuses it, and layer 0 (complete,
    fine, earlier in the order) must not have been written either."""
    model, state = _bf16_model("int8")
    _stage(model, state, [n.format(0) for n in QKV] + [n.format(1) for n in QKV])
    model.model.layers[1].self_attn.qkv_proj.staging[3, 5] = float("nan")
    before = _kernel(model)
    with pytest.raises(ValueError):
        process_weights_after_loading(model)
    assert not _unchanged(model, before), f"all or nothing: no kernel tensor may change, changed: {_unchanged(model, before)}"
    assert staged_bytes(model) == 0, "after a refused pass every staged weight is dropped (the update failed)"


@REQUANT
def test_requantize_layers_holds_no_more_than_the_staged_weights():
    """Whenever the quantizer starts on a layer, what is still alive of the staged weights
    plus the results returned so far must fit in what the staged weights took at the start:
    a result takes the place of the float weight it came from."""
    model, state = _bf16_model("int8")
    _stage(model, state, [n for n in state if n.endswith("proj.weight")])  # every linear layer, complete
    layers = {name: m for name, m in model.named_modules() if getattr(m, "staging", None) is not None}
    staged = [(weakref.ref(m.staging), m.staging.numel() * m.staging.element_size()) for m in layers.values()]
    budget = sum(n for _, n in staged)
    method, results, peaks = next(iter(layers.values())).quant_method, [], []
    real = type(method).quantize

    def watched(w):
        alive = sum(n for r, n in staged if r() is not None) + sum(n for r, n in results if r() is not None)
        peaks.append(alive)
        q, scale = real(method, w)
        results.extend((weakref.ref(t), t.numel() * t.element_size()) for t in (q, scale))
        return q, scale
    method.quantize = watched
    try:
        requantize_staged(layers)
    finally:
        del method.quantize
    assert len(peaks) == len(layers), f"each of the {len(layers)} layers is quantized once, got {len(peaks)} calls"
    assert max(peaks) <= budget, (f"held {max(peaks)} bytes of staged weights and results at once, more than the "
                                  f"{budget} the staged weights took: free a float weight once its result exists")


@REQUANT
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_requantize_layers_update_equals_cold_start_at_the_same_addresses(ckpts, quantization):
    a, b = ckpts
    engine = Engine(a, quantization=quantization)
    before = {n: (t.data_ptr(), t.shape, t.dtype) for n, t in engine.model.named_buffers()
              if n.endswith(("qweight", "weight_scale"))}
    engine.update_weights_from_disk(b)
    after = dict(engine.model.named_buffers())
    for name, (ptr, shape, dtype) in before.items():
        t = after[name]
        assert (t.data_ptr(), t.shape, t.dtype) == (ptr, shape, dtype), \
            f"{name}: storage address, shape and dtype must be unchanged (write with copy_, never rebind)"
    assert staged_bytes(engine.model) == 0, "no staging (float) weight may be left after an update"
    assert_hot_equals_cold(engine, b, ["requantize in place"], max_new_tokens=3)


# ---- ch03.layerwise_buffer -------------------------------------------------------------------

def _layer_snapshot(model):
    return {n: t.detach().clone() for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if t.device.type != "meta"}


def _by_layer(new):
    """The update's names layer after layer (layers in checkpoint order), and each layer's bytes."""
    layers: dict[str, int] = {}
    for name, t in new.items():
        layers[layer_key(name)] = layers.get(layer_key(name), 0) + t.numel() * t.element_size()
    return sorted(new, key=lambda n: list(layers).index(layer_key(n))), layers


@LAYERWISE
def test_layerwise_buffer_writes_a_layer_exactly_when_its_last_tensor_arrives_and_lets_it_go(ckpts):
    a, b = ckpts
    engine = Engine(a)
    model = engine.model
    new = dict(CheckpointReader(b).iter_tensors())
    reload = LayerwiseReload(model, list(new), "cpu")
    layer0 = [n for n in new if layer_key(n) == "model.layers.0"]
    start = _layer_snapshot(model)
    fed = []
    for name in layer0[:-1]:
        t = new[name].clone()
        fed.append(weakref.ref(t))
        reload.feed(name, t)
        del t
    now = _layer_snapshot(model)
    assert all(torch.equal(now[n], start[n]) for n in start), \
        "no weight may change before every tensor of its layer has arrived"
    assert all(r() is not None for r in fed), "the tensors of a layer not yet written must be held"
    last = new[layer0[-1]].clone()
    fed.append(weakref.ref(last))
    reload.feed(layer0[-1], last)
    del last
    changed = {layer_key(n) for n, t in _layer_snapshot(model).items() if not torch.equal(t, start[n])}
    assert changed == {"model.layers.0"}, f"after layer 0's last tensor exactly layer 0 must change, changed: {sorted(changed)}"
    assert not reload.buffers, "a layer's held tensors must be released once it is written"
    assert all(r() is None for r in fed), "once a layer is written the reload may keep no reference to its tensors"


@LAYERWISE
def test_layerwise_buffer_refuses_an_unexpected_or_repeated_name_changing_nothing(ckpts):
    """Refused: a name the update does not bring, one fed a moment ago, one of a layer
    already written. Nothing moves (``_transfer`` is not called), is held, counted or written."""
    a, b = ckpts
    engine = Engine(a)
    new = dict(CheckpointReader(b).iter_tensors())
    reload = LayerwiseReload(engine.model, list(new), "cpu")
    moved, transfer = [], reload._transfer
    reload._transfer = lambda t: moved.append(t) or transfer(t)
    for name in [n for n in new if layer_key(n) == "model.norm.weight"]:
        reload.feed(name, new[name].clone())  # the final norm: a layer of one tensor, written at once
    name = "model.layers.1.mlp.up_proj.weight"
    reload.feed(name, new[name])
    held = (len(moved), reload.held_bytes, {k: [n for n, _ in v] for k, v in reload.buffers.items()}, list(reload.applied))
    start = _layer_snapshot(engine.model)
    for bad in ("model.layers.0.mlp.not_a_proj.weight", name, "model.norm.weight"):
        with pytest.raises(UpdateError):
            reload.feed(bad, new[name].clone())
        now = (len(moved), reload.held_bytes, {k: [n for n, _ in v] for k, v in reload.buffers.items()}, list(reload.applied))
        assert now == held, (f"a refused name ({bad}) must change nothing (tensors moved, bytes held, buffers, "
                             f"layers written): before {held}, after {now}")
    assert all(torch.equal(t, start[n]) for n, t in _layer_snapshot(engine.model).items()), "a refused name wrote a weight"


@LAYERWISE
def test_layerwise_buffer_counts_what_it_holds_when_layers_interleave(ckpts):
    """A tensor of layer 1 arrives before layer 0 is complete: once layer 0 is written, that
    tensor (and only it) is still held and counted."""
    a, b = ckpts
    engine = Engine(a)
    new = dict(CheckpointReader(b).iter_tensors())
    reload = LayerwiseReload(engine.model, list(new), "cpu")
    layer0 = [n for n in new if layer_key(n) == "model.layers.0"]
    early = "model.layers.1.mlp.down_proj.weight"
    for name in layer0[:-1] + [early, layer0[-1]]:
        reload.feed(name, new[name].clone())
    size = new[early].numel() * new[early].element_size()
    assert reload.applied == ["model.layers.0"], f"exactly layer 0 is written, got {reload.applied}"
    assert [n for n, _ in reload.buffers.get("model.layers.1", [])] == [early] and len(reload.buffers) == 1, \
        f"only {early} is still held, buffers: { {k: [n for n, _ in v] for k, v in reload.buffers.items()} }"
    assert reload.held_bytes == size, f"{early} ({size} bytes) is held, {reload.held_bytes} bytes are counted"


@LAYERWISE
def test_layerwise_buffer_refuses_a_layer_with_nan_before_any_of_its_weights_change(ckpts):
    a, b = ckpts
    engine = Engine(a)
    new = dict(CheckpointReader(b).iter_tensors())
    reload = LayerwiseReload(engine.model, list(new), "cpu")
    start = _layer_snapshot(engine.model)
    names = [n for n in new if layer_key(n) == "model.layers.1"]
    poisoned = new[names[0]].clone()
    poisoned.view(-1)[0] = float("nan")
    with pytest.raises(UpdateError):
        reload.feed(names[0], poisoned)
        for name in names[1:]:
            reload.feed(name, new[name])
    changed = {layer_key(n) for n, t in _layer_snapshot(engine.model).items() if not torch.equal(t, start[n])}
    assert not changed, f"a layer holding NaN must be refused before any weight changes, changed: {sorted(changed)}"
    reload = LayerwiseReload(engine.model, list(new), "cpu", check_finite=False)
    reload.feed(names[0], poisoned)
    for name in names[1:]:
        reload.feed(name, new[name])
    assert reload.applied == ["model.layers.1"], "with check_finite=False a layer is written as it comes, NaN and all"


@LAYERWISE
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_layerwise_buffer_holds_at_most_one_layer_and_gives_every_byte_back(ckpts, quantization):
    """The point of the buffer: whatever the model's size, it holds about one layer. Fed a
    whole update layer by layer, the bytes it counts as held never pass the largest layer's;
    while a layer is written its tensors are still held and counted (beside the staging
    weights of a quantized layer), and once the last layer is written it holds (and counts)
    nothing."""
    a, b = ckpts
    engine = Engine(a, quantization=quantization)
    new = dict(CheckpointReader(b).iter_tensors())
    reload = LayerwiseReload(engine.model, list(new), "cpu")
    order, layers = _by_layer(new)
    staging = {key: 0 for key in layers}
    for name, m in engine.model.named_modules():
        if hasattr(m, "qweight"):
            staging[layer_key(name + ".weight")] += m.weight.numel() * m.weight.element_size()
    for name in order:  # one layer after another
        reload.feed(name, new[name].clone())
        assert reload.held_bytes <= max(layers.values()), \
            f"after {name}: {reload.held_bytes} bytes held, more than the largest layer's {max(layers.values())}"
    assert reload.held_bytes == 0, f"every layer is written, yet {reload.held_bytes} bytes are still counted as held"
    assert not reload.buffers, "every layer is written, yet tensors are still buffered"
    want = max(layers[k] + staging[k] for k in layers)
    assert reload.peak_held_bytes == want, (
        f"the peak counted is {reload.peak_held_bytes} bytes; the most held at once is {want}: the largest layer's "
        f"tensors, held until it is written, plus the staging weights its write creates")


@LAYERWISE
def test_layerwise_buffer_disk_update_equals_cold_start_holding_about_one_layer(ckpts):
    a, b = ckpts
    engine = Engine(a)
    result = engine.update_weights_from_disk(b)
    assert result["memory"]["layers"] == 2 + 3, "2 decoder layers + embedding, final norm and LM head must be applied"
    assert_hot_equals_cold(engine, b, ["layer by layer"], max_new_tokens=3)
