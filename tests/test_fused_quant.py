"""The fused requantization kernels (layers/fused_quant.py) give the reference quantizers'
exact bits, refuse NaN and inf as they do, and are used only where a probe shows they agree
(a quantizer that differs keeps its own path). GPU with Triton; on a CPU the engine must
take the reference path."""
import pytest
import torch

from course_lib import Engine
from course_lib.layers import fused_quant, quant
from course_lib.layers.quant import quantize_fp8_block, quantize_int8_per_channel
from course_lib.testing import GPU_TEST_SHAPE, assert_addresses_unchanged, assert_hot_equals_cold
from course_lib.weights.checkpoint import CheckpointReader

REFERENCE = {"fp8": quantize_fp8_block, "int8": quantize_int8_per_channel}
GPU_SHAPE = GPU_TEST_SHAPE


def same(a, b):
    (q1, s1), (q2, s2) = a, b
    return torch.equal(s1, s2) and torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))


def test_without_the_kernels_the_reference_quantizers_run():
    w = torch.randn(256, 256)
    assert not fused_quant.available(w)
    assert not fused_quant.agrees_with("fp8", quantize_fp8_block, "cpu", torch.float32)
    assert same(quant.Fp8Block().quantize(w), quantize_fp8_block(w))


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_kernels_give_the_reference_bits(kind, dtype):
    g = torch.Generator(device="cpu").manual_seed(5)
    shapes = [(128, 128), (1, 7), (300, 200), (4096, 1024), (1000, 4097), (129, 255)]
    for n, k in shapes:
        for scale in (1e-6, 0.02, 1.0, 5e3):
            w = (torch.randn(n, k, generator=g) * scale).to("cuda", dtype)
            w[: n // 3, : k // 3] = 0
            assert same(fused_quant.FUSED[kind](w), REFERENCE[kind](w)), (kind, dtype, n, k, scale)
    for w in fused_quant.probe_weights("cuda", dtype):
        assert same(fused_quant.FUSED[kind](w), REFERENCE[kind](w))
    assert fused_quant.agrees_with(kind, REFERENCE[kind], "cuda", dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_fused_kernels_refuse_non_finite_weights(kind, bad):
    w = torch.randn(300, 260, device="cuda", dtype=torch.bfloat16)
    w[250, 259] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        fused_quant.FUSED[kind](w)


@pytest.mark.cuda
def test_a_quantizer_that_differs_keeps_its_own_path(monkeypatch):
    def rounds_up(w):  # a wrong fp8 quantizer: its scales are half again too large
        q, s = quantize_fp8_block(w)
        return q, s * 1.5
    assert not fused_quant.agrees_with("fp8", rounds_up, "cuda", torch.bfloat16)
    monkeypatch.setattr(quant, "quantize_fp8_block", rounds_up)
    w = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    assert same(quant.Fp8Block().quantize(w), rounds_up(w))  # the engine runs the part it was given


@pytest.mark.cuda
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_in_process_quantized_update_is_hot_equals_cold(make_ckpt, quantization):
    a, b = make_ckpt("small", seed=81, **GPU_SHAPE), make_ckpt("small", seed=82, **GPU_SHAPE)
    engine = Engine(a, device="cuda", quantization=quantization, enable_cuda_graph=True)
    engine.update_weights_from_tensor([(n, t.cuda()) for n, t in CheckpointReader(b).iter_tensors()])
    assert_addresses_unchanged(engine)
    assert_hot_equals_cold(engine, b, ["fused requantization", "same bits"], max_new_tokens=8)
