"""Quantized linear layers: error bounds, the engine with int8/fp8, and hot updates that
requantize into kernel tensors whose addresses never move."""
import pytest
import torch

from course_lib import Engine
from course_lib.layers.linear import ColumnParallelLinear, QKVParallelLinear
from course_lib.layers.quant import (Fp8Block, Int8PerChannel, dequantize_fp8_block, discard_staged_weights,
                                     dequantize_int8_per_channel, fp8_block_matmul, kernel_tensors,
                                     process_weights_after_loading, quantize_fp8_block,
                                     quantize_int8_per_channel, scaled_mm_block_fp8_works)
from course_lib.testing import greedy_tokens, prompt_logits
from course_lib.weights.checkpoint import CheckpointReader

IDS = list(range(5, 45))
PROMPTS = ["quantized", "Hot weight updates requantize", "x" * 30]


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def hot_load(engine, path):
    """A hot update by hand: the model's own load path, then requantization in place."""
    engine.model.load_weights(CheckpointReader(path).iter_tensors(device=engine.config.device))
    return process_weights_after_loading(engine.model)


def quantized_layers(engine):
    return [m for m in engine.model.modules() if hasattr(m, "qweight")]


# ---- the numbers -----------------------------------------------------------------------

def test_int8_error_is_at_most_half_a_step():
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(0))
    w[7] = 0  # an all-zero row
    q, scale = quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (40,)
    err = (dequantize_int8_per_channel(q, scale) - w).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-5)).all()
    assert scale[7] == 1 and (q[7] == 0).all()
    rows = torch.arange(40) != 7
    assert (q[rows].abs().amax(dim=1) == 127).all()  # each row's largest entry uses the full range


def test_int8_rounds_half_to_even():
    q, scale = quantize_int8_per_channel(torch.tensor([[127.0, 0.5, 1.5, 2.5, -2.5]]))
    assert scale.item() == 1 and q.tolist() == [[127, 0, 2, 2, -2]]


def test_fp8_block_matmul_error_and_partial_blocks():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(300, 200, generator=gen) * 200 ** -0.5  # partial blocks in both dimensions
    w[128:256, 128:] = 0                                     # an all-zero (partial) block
    x = torch.randn(7, 200, generator=gen)
    q, scale = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (300, 200) and scale.shape == (3, 2)
    assert scale[1, 1] == 1 and (q[128:256, 128:].float() == 0).all()
    assert rel_err(x @ dequantize_fp8_block(q, scale).T, x @ w.T) < 5e-2
    # e4m3 keeps 3 mantissa bits: each element is within 2^-4 of itself, relative to its block.
    err = (dequantize_fp8_block(q, scale) - w).abs()
    assert (err <= w.abs() * 2 ** -4 + scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
            * 2 ** -9).all()


def test_direct_copy_into_int8_is_the_classic_bug():
    """Copying a float weight straight into the int8 buffer truncates it to ~0 and keeps the
    old scales; requantizing first and then copying in place is only quantization error."""
    gen = torch.Generator().manual_seed(2)
    old, new = (torch.randn(96, 64, generator=gen) * 64 ** -0.5 for _ in range(2))
    layer = ColumnParallelLinear(64, 96, quant_method=Int8PerChannel())
    layer.weight.param_name = "w"
    layer.weight.weight_loader(layer.weight, old)
    process_weights_after_loading(layer)
    ptrs = (layer.qweight.data_ptr(), layer.weight_scale.data_ptr())

    layer.qweight.copy_(new)  # shapes match, so nothing complains
    assert rel_err(layer.quant_method.dequantized_weight(layer), new) > 0.9

    layer.weight.weight_loader(layer.weight, new)
    process_weights_after_loading(layer)
    assert rel_err(layer.quant_method.dequantized_weight(layer), new) < 1e-2
    assert (layer.qweight.data_ptr(), layer.weight_scale.data_ptr()) == ptrs, "storage address unchanged"


@pytest.mark.parametrize("method", [Int8PerChannel, Fp8Block])
def test_fused_qkv_loads_like_the_unquantized_layer(method):
    """q, k and v go through the same loader, then the fused weight is quantized whole."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, 64, generator=gen) for n in (64, 32, 32))
    layer = QKVParallelLinear(64, 16, 4, 2, quant_method=method())
    layer.weight.param_name = "qkv"
    for shard, t in zip("qkv", (q, k, v)):
        layer.weight.weight_loader(layer.weight, t, shard)
    assert process_weights_after_loading(layer) == [""]
    expected_q, expected_scale = layer.quant_method.quantize(torch.cat([q, k, v]))
    assert torch.equal(layer.qweight.float(), expected_q.float()) and torch.equal(layer.weight_scale, expected_scale)
    assert layer.staging is None and layer.weight.device.type == "meta"  # the float copy is freed


def test_a_fused_layer_missing_a_shard_is_refused_before_any_change():
    layer = QKVParallelLinear(64, 16, 4, 2, quant_method=Int8PerChannel())
    layer.weight.param_name = "qkv"
    for shard, n in (("q", 64), ("k", 32), ("v", 32)):
        layer.weight.weight_loader(layer.weight, torch.randn(n, 64), shard)
    process_weights_after_loading(layer)
    before = layer.qweight.clone(), layer.weight_scale.clone()
    layer.weight.weight_loader(layer.weight, torch.randn(64, 64), "q")
    with pytest.raises(ValueError, match=r"not \['k', 'v'\]"):
        process_weights_after_loading(layer)
    assert torch.equal(layer.qweight, before[0]) and torch.equal(layer.weight_scale, before[1])
    assert layer.staging is None  # the half-made update was dropped, not kept for later
    layer.weight.weight_loader(layer.weight, torch.randn(32, 64), "v")
    assert discard_staged_weights(layer) == 1 and layer.staging is None  # what a failed update calls
    process_weights_after_loading(layer)
    assert torch.equal(layer.qweight, before[0]) and torch.equal(layer.weight_scale, before[1])


def test_shape_mismatch_names_the_parameter():
    layer = QKVParallelLinear(64, 16, 4, 2, quant_method=Fp8Block())
    layer.weight.param_name = "model.layers.0.self_attn.qkv_proj.weight"
    with pytest.raises(ValueError, match=r"qkv_proj.weight\[k\].*\(33, 64\)"):
        layer.weight.weight_loader(layer.weight, torch.randn(33, 64), "k")


# ---- the engine --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    return make_ckpt("tiny", seed=21), make_ckpt("tiny", seed=22)


def test_unknown_quantization_is_refused(ckpts):
    with pytest.raises(ValueError, match="quantization must be one of"):
        Engine(ckpts[0], quantization="int4")


# Tolerances measured on the tiny preset: int8 per-row is ~1% of the logits' norm, fp8
# blocks (3 mantissa bits) ~4%; both leave the argmax at every prompt position alone.
@pytest.mark.parametrize("quantization,tolerance", [("int8", 3e-2), ("fp8", 1e-1)])
def test_quantized_engine_is_close_to_unquantized(ckpts, quantization, tolerance):
    ref = prompt_logits(Engine(ckpts[0]), IDS)
    engine = Engine(ckpts[0], quantization=quantization)
    assert engine.quantization == quantization
    logits = prompt_logits(engine, IDS)
    assert 0 < rel_err(logits, ref) < tolerance
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    out = greedy_tokens(engine, PROMPTS, 6)
    assert [len(o) for o in out] == [6, 6, 6]


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_only_linear_layers_are_quantized(ckpts, quantization):
    model = Engine(ckpts[0], quantization=quantization).model
    assert len([m for m in model.modules() if hasattr(m, "qweight")]) == 4 * model.config.num_hidden_layers
    for name, p in model.named_parameters():
        if "proj" in name:
            assert p.device.type == "meta", name  # checkpoint-format shell: no memory
        else:
            assert p.dtype == torch.float32 and p.device.type == "cpu", name  # embeddings, LM head, norms


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_hot_update_equals_cold_start_and_addresses_stay(ckpts, quantization):
    a, b = ckpts
    engine = Engine(a, quantization=quantization, enable_prefix_caching=False)
    before = prompt_logits(engine, IDS)
    tensors = kernel_tensors(engine.model)
    assert any(name.endswith("qweight") for name in tensors) and any(name.endswith("weight_scale") for name in tensors)
    ptrs = {name: t.data_ptr() for name, t in tensors.items()}
    processed = hot_load(engine, b)
    assert len(processed) == 4 * engine.model_config.num_hidden_layers
    cold = Engine(b, quantization=quantization, enable_prefix_caching=False)
    after = prompt_logits(engine, IDS)
    assert not torch.equal(after, before)  # the update really changed the weights
    assert torch.equal(after, prompt_logits(cold, IDS)), "hot update must equal a cold start, bitwise"
    assert greedy_tokens(engine, PROMPTS) == greedy_tokens(cold, PROMPTS)
    assert {n: t.data_ptr() for n, t in kernel_tensors(engine.model).items()} == ptrs, "storage address unchanged"
    assert all(m.staging is None for m in quantized_layers(engine))


def test_partial_update_leaves_untouched_layers_bitwise(ckpts):
    a, b = ckpts
    engine = Engine(a, quantization="int8")
    layer1 = {n: t.clone() for n, t in engine.model.model.layers[1].named_buffers()}
    names = [n for n in CheckpointReader(b).metadata() if n.startswith("model.layers.0.")]
    engine.model.load_weights(CheckpointReader(b).iter_tensors(names))
    assert process_weights_after_loading(engine.model) == ["model.layers.0.self_attn.qkv_proj",
                                                           "model.layers.0.self_attn.o_proj",
                                                           "model.layers.0.mlp.gate_up_proj",
                                                           "model.layers.0.mlp.down_proj"]
    assert all(torch.equal(t, layer1[n]) for n, t in engine.model.model.layers[1].named_buffers())


# ---- GPU -------------------------------------------------------------------------------------

@pytest.mark.cuda
def test_scaled_mm_path_matches_dequantized_path():
    if not scaled_mm_block_fp8_works(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16):
        pytest.skip("this GPU/torch build has no block-scaled FP8 torch._scaled_mm; fp8 dequantizes")
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(512, 384, device="cuda", generator=gen) * 384 ** -0.5
    x = torch.randn(5, 384, device="cuda", generator=gen).bfloat16()
    q, scale = quantize_fp8_block(w)
    fast = fp8_block_matmul(x, q, scale, torch.bfloat16)
    slow = x.float() @ dequantize_fp8_block(q, scale).T
    assert rel_err(fast, slow) < 5e-2  # activation quantization (1x128 groups) plus bf16 output


@pytest.mark.cuda
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_cuda_graphs_with_quantization_survive_a_hot_update(make_ckpt, quantization):
    """The property the course is about: graphs captured on version A replay version B
    after an in-place requantization, exactly as an engine cold-started on B."""
    a, b = make_ckpt("small", seed=31), make_ckpt("small", seed=32)
    kw = dict(device="cuda", dtype="bfloat16", quantization=quantization, enable_prefix_caching=False)
    eager = Engine(a, enable_cuda_graph=False, **kw)
    engine = Engine(a, enable_cuda_graph=True, **kw)
    assert engine.model_runner.graphs, "no CUDA graph was captured"
    prompts = PROMPTS * 3
    assert greedy_tokens(engine, prompts, 16) == greedy_tokens(eager, prompts, 16)
    ptrs = {n: t.data_ptr() for n, t in kernel_tensors(engine.model).items()}
    hot_load(engine, b)
    cold = Engine(b, enable_cuda_graph=True, **kw)
    assert {n: t.data_ptr() for n, t in kernel_tensors(engine.model).items()} == ptrs
    assert greedy_tokens(engine, prompts, 16) == greedy_tokens(cold, prompts, 16)
    assert torch.equal(prompt_logits(engine, IDS), prompt_logits(cold, IDS))


@pytest.mark.cuda
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_staging_on_the_gpu_lives_beside_the_kernel_tensors_and_copies_nothing_else(quantization):
    """The staging loader (``QuantizedLinearMethod._stage``): a host shard goes through the
    layer's own loader straight into the staging tensor, which lives on the kernel tensors'
    device in the model dtype; staging both shards of gate/up allocates that tensor and
    nothing else on the device (``torch.cuda.max_memory_allocated``, measured here)."""
    import gc

    from course_lib.models.qwen3 import Qwen3ForCausalLM
    from course_lib.weights.checkpoint import preset, random_state_dict
    from course_lib.weights.checkpoint.model_loader import default_dtype

    config = preset("tiny", hidden_size=160, intermediate_size=200)
    state = random_state_dict(config, 5)  # float32 host tensors, like a checkpoint's
    with default_dtype(torch.bfloat16), torch.device("cuda"):
        model = Qwen3ForCausalLM(config, 0, 1, quantization)
    layer = model.model.layers[1].mlp.gate_up_proj
    shards = [(1, state["model.layers.1.mlp.up_proj.weight"]), (0, state["model.layers.1.mlp.gate_proj.weight"])]
    staging_bytes = layer.weight.numel() * 2  # bfloat16
    smallest = min(t.numel() for _, t in shards) * 2  # the smallest copy of a shard: in bfloat16, on the device
    gc.collect()  # an earlier test's model freed inside the window would hide allocations made in it
    gc.disable()
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for shard_id, loaded in shards:
            layer.weight.weight_loader(layer.weight, loaded, shard_id)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
    finally:
        gc.enable()
    assert layer.staging.device == layer.qweight.device and layer.staging.dtype == torch.bfloat16
    assert layer.staged_shards == {0, 1}
    assert extra < staging_bytes + smallest, (extra, staging_bytes)
    for shard_id, loaded in shards:
        start, rows = layer.shard_rows(shard_id)
        assert torch.equal(layer.staging[start:start + rows].cpu(), loaded.to(torch.bfloat16))
