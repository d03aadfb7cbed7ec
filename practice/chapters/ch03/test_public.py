"""Public tests for chapter 03's exercises (run them: python practice/judge.py test ch03).

- ch03.quantize_int8: ``quantize_int8_per_channel`` in course_lib/layers/quant.py
- ch03.stage_shard: ``QuantizedLinearMethod._stage`` in course_lib/layers/quant.py
- ch03.quantize_fp8: ``quantize_fp8_block`` in course_lib/layers/quant.py
- ch03.requantize_in_place: ``QuantizedLinearMethod.process_weights_after_loading`` in
  course_lib/layers/quant.py
- ch03.layerwise_buffer: ``LayerwiseReload.feed`` in course_lib/weights/commit/layerwise.py

Each test's name starts with its exercise's name, so ``-k quantize_int8`` runs one
exercise's cases. Each case says what it expected in words.
"""
import pytest
import torch

from course_lib import Engine
from course_lib.layers.quant import (process_weights_after_loading, quantize_fp8_block, quantize_int8_per_channel,
                                     staged_bytes)
from course_lib.weights.checkpoint.model_loader import default_dtype
from course_lib.models.qwen3 import Qwen3ForCausalLM
from course_lib.testing import assert_hot_equals_cold
from course_lib.weights.checkpoint import CheckpointReader, make_random, preset, random_state_dict
from course_lib.weights.commit.layerwise import LayerwiseReload, layer_key
from course_lib.weights.commit.validate import UpdateError

INT8 = pytest.mark.exercise("ch03.quantize_int8")
STAGE = pytest.mark.exercise("ch03.stage_shard")
FP8 = pytest.mark.exercise("ch03.quantize_fp8")
REQUANT = pytest.mark.exercise("ch03.requantize_in_place")
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


# ---- ch03.stage_shard ------------------------------------------------------------------------

def _bf16_model(quantization, tp_rank=0, tp_size=1):
    with default_dtype(torch.bfloat16):
        return Qwen3ForCausalLM(preset("tiny"), tp_rank, tp_size, quantization)


@STAGE
def test_stage_shard_fused_shards_in_any_order_land_in_one_staging_tensor():
    state = random_state_dict(preset("tiny"), 3)  # float32 checkpoint, bfloat16 model
    layer = _bf16_model("int8").model.layers[0].self_attn.qkv_proj
    shell = layer.weight
    parts = {s: state[f"model.layers.0.self_attn.{s}_proj.weight"] for s in "qkv"}
    shell.weight_loader(shell, parts["v"], "v")
    staging = layer.staging
    assert staging is not None, "the first shard must allocate layer.staging"
    assert (staging.shape, staging.dtype, staging.device) == (shell.shape, shell.dtype, layer.qweight.device), \
        (f"staging must have the shell's shape and dtype on the kernel tensors' device: expected "
         f"{list(shell.shape)} {shell.dtype} {layer.qweight.device}, got {list(staging.shape)} {staging.dtype} {staging.device}")
    assert getattr(staging, "param_name", None) == shell.param_name, \
        f"staging must carry the shell's param_name ({shell.param_name!r}) for the loaders' messages"
    assert layer.staged_shards == {"v"}, f"after v alone staged_shards must be {{'v'}}, got {layer.staged_shards}"
    assert not layer.qweight.any(), "staging must not touch the kernel tensors"
    shell.weight_loader(shell, parts["q"], "q")
    shell.weight_loader(shell, parts["k"], "k")
    assert layer.staging is staging, "later shards must land in the staging tensor the first one allocated"
    assert layer.staged_shards == {"q", "k", "v"}, f"every shard must be recorded, got {layer.staged_shards}"
    want = torch.cat([parts[s] for s in "qkv"]).to(torch.bfloat16)
    assert torch.equal(staging, want), "staging must hold q, k and v stacked in their rows, in the model dtype"


@STAGE
def test_stage_shard_quantized_rank_equals_its_unquantized_weights_quantized():
    state = random_state_dict(preset("tiny"), 4)
    plain, quantized = _bf16_model(None, 1, 2), _bf16_model("int8", 1, 2)  # rank 1 of 2: its own slice
    plain.load_weights(state.items())
    quantized.load_weights(state.items())
    assert process_weights_after_loading(quantized), "every layer received all its shards, so every one is requantized"
    for name, module in quantized.named_modules():
        if hasattr(module, "qweight"):
            q, scale = quantize_int8_per_channel(plain.get_parameter(f"{name}.weight"))
            assert torch.equal(module.qweight, q) and torch.equal(module.weight_scale, scale), \
                f"{name}: the int8 weight must be what the same unquantized layer (same slice, same rows, same dtype) quantizes to"


@STAGE
def test_stage_shard_a_wrong_shape_is_refused_by_the_layer_loader_naming_the_parameter():
    model = _bf16_model("int8")
    layer = model.model.layers[1].mlp.down_proj
    with pytest.raises(ValueError, match="down_proj"):
        layer.weight.weight_loader(layer.weight, torch.ones(1, layer.in_features))  # would broadcast
    assert not layer.staged_shards, "a refused shard must not be recorded"


# ---- ch03.quantize_fp8 -----------------------------------------------------------------------

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


# ---- ch03.requantize_in_place ----------------------------------------------------------------

@REQUANT
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_requantize_in_place_update_equals_cold_start_at_the_same_addresses(ckpts, quantization):
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


@REQUANT
def test_requantize_in_place_writes_integers_and_scales_of_the_new_weight(ckpts):
    a, b = ckpts
    engine = Engine(a, quantization="int8")
    name = "model.layers.1.mlp.down_proj.weight"
    new = dict(CheckpointReader(b).iter_tensors([name]))[name]
    engine.update_weights_from_tensor([(name, new)])
    layer = engine.model.model.layers[1].mlp.down_proj
    q, scale = quantize_int8_per_channel(new)
    assert torch.equal(layer.qweight, q), "qweight must hold the new weight's int8 values"
    assert torch.equal(layer.weight_scale, scale), "weight_scale must hold the new weight's scales"
    assert layer.staging is None and not layer.staged_shards, "the staging tensor must be freed after processing"


# ---- ch03.layerwise_buffer -------------------------------------------------------------------

def _layer_snapshot(model):
    return {n: t.detach().clone() for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if t.device.type != "meta"}


@LAYERWISE
def test_layerwise_buffer_applies_a_layer_exactly_when_its_last_tensor_arrives(ckpts):
    a, b = ckpts
    engine = Engine(a)
    model = engine.model
    new = dict(CheckpointReader(b).iter_tensors())
    reload = LayerwiseReload(model, list(new), "cpu")
    layer0 = [n for n in new if layer_key(n) == "model.layers.0"]
    start = _layer_snapshot(model)
    for name in layer0[:-1]:
        reload.feed(name, new[name].clone())
    now = _layer_snapshot(model)
    assert all(torch.equal(now[n], start[n]) for n in start), \
        "no weight may change before every tensor of its layer has arrived"
    reload.feed(layer0[-1], new[layer0[-1]].clone())
    changed = {layer_key(n) for n, t in _layer_snapshot(model).items() if not torch.equal(t, start[n])}
    assert changed == {"model.layers.0"}, f"after layer 0's last tensor exactly layer 0 must change, changed: {sorted(changed)}"
    assert not reload.buffers, "a layer's buffered tensors must be released once it is applied"


@LAYERWISE
def test_layerwise_buffer_refuses_an_unexpected_or_repeated_name(ckpts):
    a, b = ckpts
    engine = Engine(a)
    new = dict(CheckpointReader(b).iter_tensors())
    reload = LayerwiseReload(engine.model, list(new), "cpu")
    with pytest.raises(UpdateError):
        reload.feed("model.layers.0.mlp.not_a_proj.weight", torch.zeros(3))
    name = "model.layers.1.mlp.up_proj.weight"
    reload.feed(name, new[name])
    with pytest.raises(UpdateError):
        reload.feed(name, new[name])


@LAYERWISE
def test_layerwise_buffer_holds_at_most_one_layer_and_gives_every_byte_back(ckpts):
    """The point of the buffer: whatever the model's size, it holds about one layer. Fed a
    whole update layer by layer, the bytes it counts as held never pass the largest layer's,
    and once the last layer is written it holds (and counts) nothing."""
    a, b = ckpts
    engine = Engine(a)
    new = dict(CheckpointReader(b).iter_tensors())
    reload = LayerwiseReload(engine.model, list(new), "cpu")
    layers: dict[str, int] = {}
    for name, t in new.items():
        layers[layer_key(name)] = layers.get(layer_key(name), 0) + t.numel() * t.element_size()
    for name in sorted(new, key=lambda n: list(layers).index(layer_key(n))):  # one layer after another
        reload.feed(name, new[name].clone())
        assert reload.held_bytes <= max(layers.values()), \
            f"after {name}: {reload.held_bytes} bytes held, more than the largest layer's {max(layers.values())}"
    assert reload.held_bytes == 0, f"every layer is written, yet {reload.held_bytes} bytes are still counted as held"
    assert not reload.buffers, "every layer is written, yet tensors are still buffered"
    assert 0 < reload.peak_held_bytes <= max(layers.values()), \
        f"the peak counted ({reload.peak_held_bytes} bytes) is not within one layer ({max(layers.values())})"


@LAYERWISE
def test_layerwise_buffer_disk_update_equals_cold_start_holding_about_one_layer(ckpts):
    a, b = ckpts
    engine = Engine(a)
    result = engine.update_weights_from_disk(b)
    assert result["memory"]["layers"] == 2 + 3, "2 decoder layers + embedding, final norm and LM head must be applied"
    assert_hot_equals_cold(engine, b, ["layer by layer"], max_new_tokens=3)
