"""Direct requantization of hot updates (weights/commit/direct_quant.py): the general path's exact
bits written straight into the live kernel tensors, hot == cold, a refused update (NaN, a
fused layer short of a shard) changes no byte, and the path stands aside wherever a part it
does its own way is not the instructor edition's (a changed exercise, a wrong quantizer,
the environment switch, a plugged-in commit step). On a CPU the GPU path's bookkeeping runs
with torch stand-ins for the fused kernels; the kernels themselves are the cuda-marked tests."""
from types import SimpleNamespace

import pytest
import torch

from course_lib import Engine
from course_lib.update.updater import Updater
from course_lib.exercises import is_reference
from course_lib.layers import fused_quant, quant
from course_lib.weights.commit import direct_quant
from course_lib.layers.quant import QuantizedLinearMethod, kernel_tensors, pending_layers, staged_bytes
from course_lib.weights.checkpoint.model_loader import build_model
from course_lib.testing import GPU_TEST_SHAPE, assert_addresses_unchanged, assert_hot_equals_cold, plugged_commit
from course_lib.weights.checkpoint import CheckpointReader, preset, write_checkpoint
from course_lib.weights.commit.audit import AddressMovedError
from course_lib.weights.commit.validate import UpdateError

# GPU_TEST_SHAPE's dimensions in float32: q, k, v, gate and up each start on a 128-row
# boundary, so every FP8 tile belongs to one shard and the direct path takes FP8 updates too.
ALIGNED = {**GPU_TEST_SHAPE, "torch_dtype": "float32"}
PROMPTS = ["direct requantization", "x" * 20]


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    """name -> (a, b): two checkpoints of one shape (tiny: FP8 shards share tiles; aligned:
    they do not; bf16: the aligned shape in bfloat16)."""
    return {"tiny": (make_ckpt("tiny", seed=91), make_ckpt("tiny", seed=92)),
            "aligned": (make_ckpt("tiny", seed=93, **ALIGNED), make_ckpt("tiny", seed=94, **ALIGNED)),
            "bf16": (make_ckpt("tiny", seed=95, **GPU_TEST_SHAPE), make_ckpt("tiny", seed=96, **GPU_TEST_SHAPE))}


def tensors(path, names=None):
    return list(CheckpointReader(path).iter_tensors(names))


def kernel_bytes(engine) -> dict[str, torch.Tensor]:
    """Every tensor the kernels read, as raw bytes (float8 has no equality of its own)."""
    return {n: t.detach().reshape(-1).view(torch.uint8).clone() for n, t in kernel_tensors(engine.model).items()}


def changed(before: dict, after: dict) -> list[str]:
    return [n for n in before if not torch.equal(before[n], after[n])]


@pytest.fixture
def paths(monkeypatch):
    """Which writer each update took, from its result: ``paths.direct`` (per update, whether
    the direct requantization wrote it) and ``paths.general`` (how many the general path wrote)."""
    seen = SimpleNamespace(direct=[], general=0)
    update = Updater.update

    def recording(self, source, options=None):
        result = update(self, source, options)
        seen.direct.append(result["writer"] == "direct_quant")
        seen.general += result["writer"] == "general"
        return result
    monkeypatch.setattr(Updater, "update", recording)
    return seen


# ---- the same bits as the general path, hot == cold ------------------------------------------

@pytest.mark.parametrize("quantization,shape,dtype", [("int8", "tiny", None), ("int8", "aligned", None),
                                                      ("fp8", "aligned", None), ("fp8", "bf16", "bfloat16"),
                                                      ("int8", "aligned", "bfloat16"), ("fp8", "aligned", "float16")])
def test_direct_path_writes_the_general_paths_bits(ckpts, paths, monkeypatch, quantization, shape, dtype):
    """``dtype``: the engine's (None: float32 on a CPU); float32 tensors into a bf16 or fp16
    engine are rounded first, as the general path's staging copy rounds them."""
    a, b = ckpts[shape]
    new = tensors(b)
    direct, general = (Engine(a, quantization=quantization, dtype=dtype) for _ in range(2))
    direct.update_weights_from_tensor(new)
    assert paths.direct == [True] and paths.general == 0
    monkeypatch.setenv("COURSE_LIB_DIRECT_QUANT", "0")
    general.update_weights_from_tensor(new)
    assert paths.direct == [True, False] and paths.general == 1
    got, want = kernel_bytes(direct), kernel_bytes(general)
    assert not changed(want, got), f"direct != general in {changed(want, got)[:4]}"
    assert staged_bytes(direct.model) == 0


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_direct_update_is_hot_equals_cold_at_the_same_addresses(ckpts, paths, quantization):
    a, b = ckpts["aligned"]
    engine = Engine(a, quantization=quantization, enable_prefix_caching=False)
    ptrs = {n: t.data_ptr() for n, t in kernel_tensors(engine.model).items()}
    before = kernel_bytes(engine)
    result = engine.update_weights_from_tensor(tensors(b))
    assert paths.direct == [True] and paths.general == 0
    assert "post_process" not in result["timings_ms"] and "copy" in result["timings_ms"]
    cold = Engine(b, quantization=quantization, enable_prefix_caching=False)
    hot_bytes, cold_bytes = kernel_bytes(engine), kernel_bytes(cold)
    assert any(n.endswith("qweight") for n in changed(before, hot_bytes)), "the update changed nothing"
    assert not changed(cold_bytes, hot_bytes), f"hot != cold in {changed(cold_bytes, hot_bytes)[:4]}"
    assert_hot_equals_cold(engine, b, PROMPTS, max_new_tokens=6, cold=cold)
    assert {n: t.data_ptr() for n, t in kernel_tensors(engine.model).items()} == ptrs
    assert_addresses_unchanged(engine)


def test_fp8_shards_that_share_tiles_take_the_general_path(ckpts, paths):
    """tiny: k starts at row 64, inside q's last tile; the update is left to the general path."""
    a, b = ckpts["tiny"]
    engine = Engine(a, quantization="fp8")
    engine.update_weights_from_tensor(tensors(b))
    assert paths.direct == [False] and paths.general == 1
    assert not changed(kernel_bytes(Engine(b, quantization="fp8")), kernel_bytes(engine))


def test_the_plan_is_the_layers_own_rows(ckpts):
    model = Engine(ckpts["aligned"][0], quantization="fp8").model
    plan = direct_quant.plan(model)
    assert plan is direct_quant.plan(model), "made once, then kept"
    layers = model.config.num_hidden_layers
    assert len(plan.shards) == 7 * layers and len(plan.layers) == 4 * layers
    k = plan.shards["model.layers.1.self_attn.k_proj.weight"]
    assert k.layer == "model.layers.1.self_attn.qkv_proj"
    assert (k.first, k.rows) == k.module.shard_rows("k") == (256, 128)
    assert all(s.own_tiles for s in plan.shards.values())
    tiny = direct_quant.plan(Engine(ckpts["tiny"][0], quantization="fp8").model)
    # q, k, v: 64, 32 and 32 rows in one 128-row tile
    assert not any(tiny.shards[f"model.layers.0.self_attn.{p}_proj.weight"].own_tiles for p in "qkv")
    assert tiny.shards["model.layers.0.self_attn.o_proj.weight"].own_tiles  # 64 rows: it ends at the layer's last row


# ---- refusals change nothing -----------------------------------------------------------------

@pytest.mark.parametrize("quantization", ["int8", "fp8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_in_one_tensor_is_refused_and_no_byte_changes(ckpts, paths, quantization, bad):
    a, b = ckpts["aligned"]
    engine = Engine(a, quantization=quantization, enable_prefix_caching=False)
    before = kernel_bytes(engine)
    new = [(n, t.clone()) for n, t in tensors(b)]  # the norms and embedding change too
    dict(new)["model.layers.1.mlp.up_proj.weight"][5, 7] = bad
    with pytest.raises(UpdateError, match=r"model\.layers\.1\.mlp\.gate_up_proj: the weight holds NaN or infinite"):
        engine.update_weights_from_tensor(new)
    assert paths.general == 0
    assert not changed(before, kernel_bytes(engine)), "a refused update changed the weights"
    assert staged_bytes(engine.model) == 0 and not pending_layers(engine.model)
    assert engine.health()["healthy"] and engine.weight_update_count == 0
    assert_hot_equals_cold(engine, a, PROMPTS[:1], max_new_tokens=4)  # still serves the old weights
    engine.update_weights_from_tensor(tensors(b))                     # and takes the next update
    assert_hot_equals_cold(engine, b, PROMPTS[:1], max_new_tokens=4)


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_the_general_path_too_refuses_nan_before_writing_anything(ckpts, paths, monkeypatch, quantization):
    """With the direct path off (as in the student edition), NaN in a later layer is refused
    before the norms or the earlier layers are written, not by the quantizer halfway."""
    monkeypatch.setenv("COURSE_LIB_DIRECT_QUANT", "0")
    a, b = ckpts["aligned"]
    engine = Engine(a, quantization=quantization, enable_prefix_caching=False)
    before = kernel_bytes(engine)
    new = [(n, t.clone()) for n, t in tensors(b)]
    dict(new)["model.layers.1.mlp.up_proj.weight"][5, 7] = float("nan")
    with pytest.raises(UpdateError, match=r"model\.layers\.1\.mlp\.up_proj\.weight: contains NaN or infinite"):
        engine.update_weights_from_tensor(new)
    assert not changed(before, kernel_bytes(engine)), "a refused update changed the weights"
    assert staged_bytes(engine.model) == 0 and not pending_layers(engine.model)
    assert engine.health()["healthy"] and engine.weight_update_count == 0
    engine.update_weights_from_tensor(tensors(b))
    assert_hot_equals_cold(engine, b, PROMPTS[:1], max_new_tokens=4)


def test_a_partial_update_leaves_the_other_layers_unchanged(ckpts, paths):
    a, b = ckpts["aligned"]
    engine = Engine(a, quantization="int8")
    before = kernel_bytes(engine)
    engine.update_weights_from_tensor(tensors(b, [n for n in CheckpointReader(b).metadata()
                                                  if n.startswith("model.layers.0.")]))
    assert paths.direct == [True]
    after, cold = kernel_bytes(engine), kernel_bytes(Engine(b, quantization="int8"))
    layer0 = [n for n in after if n.startswith("model.layers.0.")]
    assert layer0 and not changed({n: cold[n] for n in layer0}, after)
    assert set(changed(before, after)) <= set(layer0)
    assert {n for n in layer0 if n.endswith(("qweight", "weight_scale"))} <= set(changed(before, after))


def test_a_fused_layer_short_of_a_shard_is_refused_before_any_write(ckpts, paths, tmp_path):
    """A full staging update (no chunks to wait for) with v_proj missing: refused whole,
    the norm and the complete layers in it written neither."""
    a, b = ckpts["aligned"]
    engine = Engine(a, quantization="fp8")
    before = kernel_bytes(engine)
    config = engine.model_config
    names = [n for n in CheckpointReader(b).metadata() if not n.endswith("layers.0.self_attn.v_proj.weight")]
    partial = write_checkpoint(tmp_path / "partial", config, dict(tensors(b, names)))
    refusal = r"layers\.0\.self_attn\.qkv_proj: received shards \['k', 'q'\] but not \['v'\]"
    with pytest.raises(UpdateError, match=refusal):
        engine.update_weights_from_disk(partial, partial=True, staging="full")
    assert paths.general == 0
    assert not changed(before, kernel_bytes(engine)) and staged_bytes(engine.model) == 0
    assert engine.health()["healthy"]


def test_chunks_that_split_a_fused_layer_take_the_general_path(ckpts, paths):
    """q in one chunk, k and v in the next: staged and finished by the general path; a
    complete chunk afterwards is direct again."""
    a, b = ckpts["aligned"]
    engine = Engine(a, quantization="int8")
    q, k, v = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")
    engine.pause_generation("abort")
    engine.update_weights_from_tensor(tensors(b, [q]))
    assert pending_layers(engine.model) == {"model.layers.0.self_attn.qkv_proj": ["k", "v"]}
    engine.update_weights_from_tensor(tensors(b, [k, v]))
    assert paths.direct == [False, False] and paths.general == 2 and not pending_layers(engine.model)
    engine.update_weights_from_tensor(tensors(a, [q]))
    engine.update_weights_from_tensor(tensors(b))  # complete, but q of the last chunk is staged: general
    assert paths.direct == [False, False, False, False] and not pending_layers(engine.model)
    engine.continue_generation()
    engine.update_weights_from_tensor(tensors(b))
    assert paths.direct[-1] is True and paths.general == 4
    assert_hot_equals_cold(engine, b, PROMPTS[:1], max_new_tokens=4)


def test_apply_checks_the_shapes_it_assumes(ckpts):
    model = Engine(ckpts["aligned"][0], quantization="int8").model
    before = {n: t.clone() for n, t in model.named_buffers()}
    bad = [(f"model.layers.0.self_attn.{p}_proj.weight", torch.zeros(128, 256)) for p in "qkv"]  # q has 256 rows
    with pytest.raises(UpdateError, match=r"q_proj.weight: .*\(128, 256\), expected .*\(256, 256\)"):
        direct_quant.apply(model, bad, "cpu")
    assert all(torch.equal(t, before[n]) for n, t in model.named_buffers())


def test_the_update_audits_what_the_loaders_wrote_and_the_resume_audits_everything(ckpts, paths):
    """The direct path writes through the kernel tensors the layers hold now (it never
    rebinds), so the update audits only the parameters the loaders wrote (norms, embedding);
    a kernel tensor moved by something else is still caught, by the full audit at resume."""
    a, b = ckpts["aligned"]
    engine = Engine(a, quantization="int8")
    engine.pause_generation("retract")
    layer = engine.model.model.layers[0].mlp.down_proj
    layer.qweight = layer.qweight.clone()  # a bug elsewhere: the kernels' memory is no longer the layer's
    result = engine.update_weights_from_tensor(tensors(b))
    assert result["success"] and paths.direct == [True]
    with pytest.raises(AddressMovedError, match=r"down_proj.qweight: data_ptr changed"):
        engine.continue_generation()


# ---- the gates: the direct path only stands in for the instructor edition's parts -------------

def test_every_part_the_direct_path_stands_in_for_is_the_reference_here():
    """In the instructor edition each of these parts (exercise regions, a quant method's
    quantize) is the reference, so the direct path may run; a builtin never is."""
    for kind in direct_quant.QUANTIZERS:
        for label, func in direct_quant.reference_parts(kind).items():
            assert is_reference(func, label if label.startswith("ch") else None), f"{label} ({func.__qualname__})"
    assert not is_reference(len)


def test_the_switch_and_the_engines_that_are_not_its(ckpts, paths, monkeypatch):
    a, b = ckpts["aligned"]
    engine = Engine(a, quantization="int8")
    assert direct_quant.why_not(engine.model) is None
    monkeypatch.setenv("COURSE_LIB_DIRECT_QUANT", "0")
    assert direct_quant.why_not(engine.model) == "COURSE_LIB_DIRECT_QUANT=0"
    engine.update_weights_from_tensor(tensors(b))
    assert paths.direct == [False] and paths.general == 1
    monkeypatch.delenv("COURSE_LIB_DIRECT_QUANT")
    assert "not quantized" in direct_quant.why_not(Engine(a).model)
    config = CheckpointReader(a).config
    assert "tensor-parallel" in direct_quant.why_not(build_model(config, "cpu", torch.float32, 0, 2, "int8"))


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_a_wrong_quantizer_turns_the_direct_path_off(ckpts, paths, monkeypatch, quantization):
    """The general path runs the quantizer it is given (here one whose scales are half again
    too large), and the engine then holds exactly that quantizer's result."""
    a, b = ckpts["aligned"]
    name = direct_quant.QUANTIZERS[quantization][1]
    reference = getattr(quant, name)

    def too_large(w):
        q, s = reference(w)
        return q, s * 1.5
    monkeypatch.setattr(quant, name, too_large)
    engine = Engine(a, quantization=quantization)  # built after the change, as a learner's is
    assert f"ch03.quantize_{quantization}" in direct_quant.why_not(engine.model)
    engine.update_weights_from_tensor(tensors(b))
    assert paths.direct == [False] and paths.general == 1
    layer = engine.model.model.layers[0].mlp.down_proj
    _, scale = too_large(dict(tensors(b))["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(layer.weight_scale, scale)


@pytest.mark.parametrize("part", ["_stage", "requantize_staged"])
def test_a_changed_staging_or_requantization_turns_the_direct_path_off(ckpts, paths, monkeypatch, part):
    """A learner's requantization pass, or a staging loader replaced at run time (here the
    reference wrapped, so its code differs), is what runs: the engine is built after the
    change, as a learner's is."""
    a, b = ckpts["aligned"]
    calls = []
    if part == "_stage":
        original = QuantizedLinearMethod._stage

        def learners_version(self, *args, **kwargs):
            calls.append(args[-1])
            return original(self, *args, **kwargs)
        monkeypatch.setattr(QuantizedLinearMethod, part, learners_version)
        label = "Int8PerChannel._stage"
    else:
        original = quant.requantize_staged

        def learners_version(layers, allow_pending=False):
            calls.append(sorted(layers))
            return original(layers, allow_pending)
        monkeypatch.setattr(quant, part, learners_version)
        label = "ch03.requantize_layers"
    engine = Engine(a, quantization="int8")
    assert direct_quant.why_not(engine.model).startswith(label)
    calls.clear()
    engine.update_weights_from_tensor(tensors(b))
    assert paths.direct == [False] and paths.general == 1 and calls, "the learner's part did not run"
    assert_hot_equals_cold(engine, b, PROMPTS[:1], max_new_tokens=4)


def test_a_method_replaced_on_the_instance_turns_the_direct_path_off(ckpts):
    engine = Engine(ckpts["aligned"][0], quantization="int8")
    method = engine.model.model.layers[0].mlp.down_proj.quant_method
    method.quantize = quant.quantize_int8_per_channel
    assert "replaced on the instance" in direct_quant.why_not(engine.model)


def test_an_unwritten_shard_rows_stops_the_general_path_with_its_own_message(ckpts, paths, monkeypatch):
    """The plan asks the layers' shard_rows; where that part is a stub, the general path runs
    and stops at the stub, as it would with no direct path at all."""
    from course_lib.layers.linear import QKVParallelLinear
    engine = Engine(ckpts["aligned"][0], quantization="int8")
    engine.model.__dict__.pop("_direct_quant_plan")  # made when the engine read its parts

    def stub(self, shard_id):
        raise NotImplementedError("ch01.qkv_rows: write this part")
    monkeypatch.setattr(QKVParallelLinear, "shard_rows", stub)
    engine.updater.commit = None  # the engine reads its parts again, as when a commit step is plugged in
    assert direct_quant.why_not(engine.model).startswith("no plan: NotImplementedError")
    with pytest.raises(NotImplementedError, match="ch01.qkv_rows"):
        engine.update_weights_from_tensor(tensors(ckpts["aligned"][1]))
    assert paths.direct == [] and "_direct_quant_plan" not in engine.model.__dict__, "no update landed, no plan kept"


def test_a_plugged_in_commit_step_runs_instead(ckpts, paths):
    a, b = ckpts["aligned"]
    engine, committed = Engine(a, quantization="int8"), []

    def learners_commit(model, named_tensors):
        committed.extend(n for n, _ in named_tensors)
        model.load_weights(named_tensors)
    with plugged_commit(engine, learners_commit):
        result = engine.update_weights_from_tensor(tensors(b))
    assert paths.direct == [False] and paths.general == 1 and len(committed) == len(tensors(b))
    assert "plugged in" in result["writers_declined"]["direct_quant"], "the result says why the fast path stood aside"
    assert_hot_equals_cold(engine, b, PROMPTS[:1], max_new_tokens=4)


def torch_kernels(monkeypatch):
    """Torch stand-ins for the two fused passes (the same contracts: over several weights,
    into the tensors given), so that the GPU path's bookkeeping (one buffer for every scale,
    the one check, each shard's rows and tile rows) runs on a CPU. The kernels themselves
    are tested on a GPU below."""
    def scales_of(kind, w, scale, bad):
        x = w.float()
        if kind == "int8":
            amax, nonfinite = x.abs().amax(dim=1), (~torch.isfinite(x)).sum(dim=1)
            peak = 127.0
        else:
            (n, k), (nb, kb) = w.shape, fused_quant.scale_shape(kind, w)
            tiles = torch.nn.functional.pad(x, (0, kb * 128 - k, 0, nb * 128 - n)).view(nb, 128, kb, 128)
            amax, nonfinite, peak = tiles.abs().amax(dim=(1, 3)), (~torch.isfinite(tiles)).sum(dim=(1, 3)), quant.FP8_MAX
        scale.copy_(torch.where(amax > 0, amax / peak, torch.ones_like(amax)).flatten())
        bad.copy_(nonfinite.flatten())

    def quant_of(kind, w, q, scale):
        shape = fused_quant.scale_shape(kind, w)
        if kind == "int8":
            q.copy_(torch.round(w.float() / scale[:, None]).clamp_(-127, 127).to(torch.int8))
        else:
            v = w.float() / quant.expand_block_scale(scale.view(shape), w.shape)
            q.copy_(v.clamp(-quant.FP8_MAX, quant.FP8_MAX).to(torch.float8_e4m3fn))

    def split(kind, ws, *flat):
        sizes = [torch.Size(fused_quant.scale_shape(kind, w)).numel() for w in ws]
        return zip(ws, *(t.split(sizes) for t in flat))

    def scales_pass(kind, ws, scale, bad):
        for w, sc, bd in split(kind, ws, scale, bad):
            scales_of(kind, w, sc, bd)

    def quant_pass(kind, ws, qs, scale):
        for (w, sc), q in zip(split(kind, ws, scale), qs):
            quant_of(kind, w, q, sc)
    calls = []
    for f in (scales_pass, quant_pass):
        monkeypatch.setattr(fused_quant, f.__name__, lambda *args, _f=f: calls.append(_f.__name__) or _f(*args))
    monkeypatch.setattr(fused_quant, "triton", object())
    monkeypatch.setattr(fused_quant, "available", lambda w: True)
    monkeypatch.setattr(fused_quant, "agrees_with", lambda *args: True)
    return calls


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_the_gpu_paths_bookkeeping_with_torch_kernels(ckpts, paths, monkeypatch, quantization):
    a, b = ckpts["aligned"]
    general, direct = (Engine(a, quantization=quantization) for _ in range(2))
    monkeypatch.setenv("COURSE_LIB_DIRECT_QUANT", "0")
    general.update_weights_from_tensor(tensors(b))
    monkeypatch.delenv("COURSE_LIB_DIRECT_QUANT")
    calls = torch_kernels(monkeypatch)
    before = kernel_bytes(direct)
    bad = [(n, t.clone()) for n, t in tensors(b)]
    dict(bad)["model.layers.1.self_attn.v_proj.weight"][100, 3] = float("inf")
    with pytest.raises(UpdateError, match=r"layers\.1\.self_attn\.qkv_proj: the weight holds NaN or infinite"):
        direct.update_weights_from_tensor(bad)
    assert calls == ["scales_pass"] and not changed(before, kernel_bytes(direct))
    direct.update_weights_from_tensor(tensors(b))
    assert calls[1:] == ["scales_pass", "quant_pass"]  # every scale first (one launch), then the writes
    assert paths.direct == [False, True] and paths.general == 1  # the general engine, then this one
    assert not changed(kernel_bytes(general), kernel_bytes(direct))


# ---- GPU -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_ckpts(make_ckpt):
    return make_ckpt("small", seed=97, **GPU_TEST_SHAPE), make_ckpt("small", seed=98, **GPU_TEST_SHAPE)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_fused_passes_write_several_weights_into_row_ranges_of_a_larger_tensor(kind):
    """Both passes over three weights in one launch each: scales into one buffer after 5
    untouched entries, values into rows [0, 384), [384, 512) and [640, 770) of a
    live-like tensor: the reference's bits there, every other row untouched."""
    g = torch.Generator(device="cpu").manual_seed(7)
    ws = [(torch.randn(n, 300, generator=g) * 0.05).to("cuda", torch.bfloat16) for n in (384, 128, 130)]
    ws[0][:128, :128] = 0
    reference = getattr(quant, direct_quant.QUANTIZERS[kind][1])
    refs = [reference(w) for w in ws]
    qdtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
    live = torch.zeros(1024, 300, dtype=torch.uint8, device="cuda").view(qdtype)
    sizes = [s.numel() for _, s in refs]
    scales = torch.full((sum(sizes) + 5,), -1.0, device="cuda")
    bad = torch.full((sum(sizes) + 5,), -1, dtype=torch.int32, device="cuda")
    firsts = (0, 384, 640)
    fused_quant.scales_pass(kind, ws, scales[5:], bad[5:])
    fused_quant.quant_pass(kind, ws, [live.narrow(0, f, w.shape[0]) for f, w in zip(firsts, ws)], scales[5:])
    assert (scales[:5] == -1).all() and int(bad[5:].sum()) == 0
    for (ref_q, ref_s), scale, f in zip(refs, scales[5:].split(sizes), firsts):
        assert torch.equal(scale.view(ref_s.shape), ref_s)
        assert torch.equal(live[f:f + ref_q.shape[0]].view(torch.uint8), ref_q.view(torch.uint8))
    assert not live[512:640].view(torch.uint8).any() and not live[770:].view(torch.uint8).any()


@pytest.mark.cuda
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
@pytest.mark.parametrize("fused", [True, False])
def test_gpu_direct_path_writes_the_general_paths_bits(gpu_ckpts, paths, monkeypatch, quantization, fused):
    """``fused=False``: kernels that would not agree with the reference; the direct path then
    quantizes each shard with the reference quantizer on the GPU."""
    a, b = gpu_ckpts
    new = [(n, t.cuda()) for n, t in tensors(b)]
    kw = dict(device="cuda", quantization=quantization, enable_cuda_graph=False)
    direct, general = Engine(a, **kw), Engine(a, **kw)
    passes = []
    original = fused_quant.quant_pass
    monkeypatch.setattr(fused_quant, "quant_pass", lambda *args: passes.append(len(args[1])) or original(*args))
    with monkeypatch.context() as m:
        if not fused:
            m.setattr(fused_quant, "agrees_with", lambda *args: False)
        direct.update_weights_from_tensor(new)
    assert paths.direct == [True] and paths.general == 0
    shards = 7 * direct.model_config.num_hidden_layers
    assert passes == ([shards] if fused else []), "every shard written by one fused launch, or none"
    monkeypatch.setenv("COURSE_LIB_DIRECT_QUANT", "0")
    general.update_weights_from_tensor(new)
    got, want = kernel_bytes(direct), kernel_bytes(general)
    assert not changed(want, got), f"direct != general in {changed(want, got)[:4]}"


@pytest.mark.cuda
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_gpu_direct_update_is_hot_equals_cold_under_cuda_graphs(gpu_ckpts, paths, quantization):
    a, b = gpu_ckpts
    kw = dict(device="cuda", quantization=quantization, enable_cuda_graph=True, enable_prefix_caching=False)
    engine = Engine(a, **kw)
    ptrs = {n: t.data_ptr() for n, t in kernel_tensors(engine.model).items()}
    engine.update_weights_from_tensor([(n, t.cuda()) for n, t in tensors(b)])
    assert paths.direct == [True] and paths.general == 0
    cold = Engine(b, **kw)
    assert not changed(kernel_bytes(cold), kernel_bytes(engine))
    assert {n: t.data_ptr() for n, t in kernel_tensors(engine.model).items()} == ptrs
    assert_addresses_unchanged(engine)
    assert_hot_equals_cold(engine, b, PROMPTS, max_new_tokens=8, cold=cold)


@pytest.mark.cuda
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_gpu_nan_is_refused_and_no_byte_changes(gpu_ckpts, paths, quantization):
    a, b = gpu_ckpts
    engine = Engine(a, device="cuda", quantization=quantization, enable_cuda_graph=True)
    before = kernel_bytes(engine)
    new = [(n, t.cuda()) for n, t in tensors(b)]
    dict(new)["model.layers.1.self_attn.k_proj.weight"][3, 9] = float("nan")
    with pytest.raises(UpdateError, match=r"layers\.1\.self_attn\.qkv_proj: the weight holds NaN or infinite"):
        engine.update_weights_from_tensor(new)
    assert paths.general == 0 and not changed(before, kernel_bytes(engine))
    assert_hot_equals_cold(engine, a, PROMPTS[:1], max_new_tokens=4)


def test_the_gpu_tests_shape_gives_every_fp8_shard_its_own_tiles():
    """Else the GPU tests above would test the general path."""
    config = preset("small", **GPU_TEST_SHAPE)
    model = build_model(config, "meta", torch.bfloat16, quantization="fp8")
    assert all(s.own_tiles for s in direct_quant.Plan(model).shards.values())
