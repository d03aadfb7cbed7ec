"""The hot disk update's fast path: parallel reads (pinned on a GPU) that keep the file
identity checks of the plain reader, a one-pass finiteness check, and a rollback point
saved on a side stream. The reader's pipeline runs on a CPU too (plain buffers), so its
segmenting, threads and identity checks are tested here; the GPU cases are marked."""
import os
import shutil

import pytest
import torch

from course_lib import Engine
from course_lib.layers.quant import kernel_tensors
from course_lib.testing import GPU_TEST_SHAPE, assert_addresses_unchanged, assert_hot_equals_cold
from course_lib.weights.checkpoint import reader as checkpoint
from course_lib.weights.checkpoint import instanttensor_reader, pinned_reader
from course_lib.weights.commit import rollback
from course_lib.weights.checkpoint import CheckpointError, CheckpointReader, write_checkpoint
from course_lib.weights.commit.layerwise import layer_key
from course_lib.weights.checkpoint.pinned_reader import iter_safetensors_to_gpu, plan_segments
from course_lib.weights.checkpoint.safetensors_format import (check_unchanged, file_identity, iter_safetensors_file,
                                                   open_checked, read_safetensors_header, tensor_entries)
from course_lib.weights.commit.validate import UpdateError, check_finite

PROMPTS = ["the fast path", "writes what the plain path writes"]
GPU_SHAPE = GPU_TEST_SHAPE


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    return make_ckpt("small", seed=61), make_ckpt("small", seed=62)


@pytest.fixture
def small_chunks(monkeypatch):
    """Segments of 3000 bytes in a ring of 3, read by 4 threads in parts of 512 bytes:
    small tensors share a segment, large ones span several, every buffer is reused."""
    monkeypatch.setattr(pinned_reader, "CHUNK_BYTES", 3000)
    monkeypatch.setattr(pinned_reader, "RING_BUFFERS", 3)
    monkeypatch.setattr(pinned_reader, "READ_THREADS", 4)
    monkeypatch.setattr(pinned_reader, "MIN_PART", 512)


def safetensors_file(ckpt):
    return os.path.join(ckpt, "model.safetensors")


# ---- the finiteness check ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_check_finite_names_the_first_bad_tensor(dtype, value):
    good = [(f"ok{i}", torch.randn(50).to(dtype)) for i in range(3)]
    bad = torch.randn(7, 9).to(dtype)
    bad[3, 4] = value
    later = torch.full((4,), value, dtype=torch.float32)
    with pytest.raises(UpdateError, match=r"^bad: contains NaN or infinite values"):
        check_finite(good[:2] + [("bad", bad), ("later", later)] + good[2:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_check_finite_passes_huge_finite_values_empty_and_integer_tensors(dtype):
    top = torch.finfo(dtype).max
    check_finite([("max", torch.tensor([top, -top, 0.0], dtype=dtype)), ("empty", torch.empty(0, 3, dtype=dtype)),
                  ("ints", torch.arange(5)), ("scalar", torch.tensor(1.5, dtype=dtype))])


def test_check_finite_makes_no_tensor_sized_temporaries(monkeypatch):
    """isfinite runs on the gathered scalars only: never on (a copy of) a whole tensor."""
    sizes = []
    real = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: sizes.append(t.numel()) or real(t))
    check_finite([(f"w{i}", torch.randn(64, 64)) for i in range(5)])
    assert sizes and max(sizes) <= 5, sizes


# ---- the read plan and the pipeline on a CPU ----------------------------------------------------

def test_segments_cover_every_wanted_byte_once_and_skip_the_rest(ckpts):
    file = safetensors_file(ckpts[0])
    header, data_start = read_safetensors_header(file)
    names = sorted(header)
    wanted = set(names[::3]) | {n for n in names if "norm" in n}
    entries = tensor_entries(header, file, wanted)
    segments = plan_segments(entries, data_start, 1000)
    covered = {}
    for offset, length, pieces in segments:
        assert 0 < length <= 1000 or not any(p[3] for p in pieces)
        assert sum(p[3] for p in pieces) == length
        for i, at, s, m in pieces:
            assert s + m <= length
            _, _, _, begin, end = entries[i]
            assert offset + s == data_start + begin + at  # contiguous in the file
            covered[i] = covered.get(i, 0) + m
    assert covered == {i: e[4] - e[3] for i, e in enumerate(entries)}
    assert sum(length for _, length, _ in segments) == sum(e[4] - e[3] for e in entries)


@pytest.mark.parametrize("sharded", [False, True])
def test_parallel_reader_reads_exactly_what_the_plain_reader_reads(make_ckpt, small_chunks, sharded):
    ckpt = make_ckpt("small", seed=63, max_shard_size=60_000 if sharded else None, torch_dtype="bfloat16")
    reader = CheckpointReader(ckpt)
    reader.metadata()
    names = sorted(reader.metadata())
    wanted = set(names[1::2])
    for file in reader._unique_files():
        plain = list(iter_safetensors_file(file, wanted))
        fast = list(iter_safetensors_to_gpu(file, wanted, "cpu", file_identity(file)))
        assert [n for n, _ in fast] == [n for n, _ in plain]
        for (name, a), (_, b) in zip(plain, fast):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


def test_empty_tensors_are_handed_out_in_place(tmp_path, small_chunks):
    tensors = {"a": torch.randn(700), "b": torch.empty(0, 4), "c": torch.randn(3, 5), "d": torch.empty(0)}
    from safetensors.torch import save_file
    save_file(tensors, str(tmp_path / "x.safetensors"))
    got = dict(iter_safetensors_to_gpu(tmp_path / "x.safetensors", None, "cpu"))
    assert got.keys() == tensors.keys()
    assert all(torch.equal(got[k], v) and got[k].shape == v.shape for k, v in tensors.items())


def test_an_abandoned_read_frees_the_ring_for_the_next(ckpts, small_chunks):
    file = safetensors_file(ckpts[0])
    first = iter_safetensors_to_gpu(file, None, "cpu")
    next(first)
    second = dict(iter_safetensors_to_gpu(file, None, "cpu"))  # the ring is busy: a temporary one
    first.close()
    third = dict(iter_safetensors_to_gpu(file, None, "cpu"))  # the kept ring, free again
    plain = dict(iter_safetensors_file(file))
    assert all(torch.equal(second[n], t) and torch.equal(third[n], t) for n, t in plain.items())
    key = ("cpu", pinned_reader.READ_THREADS, pinned_reader.RING_BUFFERS, pinned_reader.CHUNK_BYTES)
    assert not pinned_reader._PIPELINES[key].lock.locked()


# ---- file identity, one check for both readers ----------------------------------------------------

def test_identity_functions_refuse_a_replaced_or_changed_file(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    identity = file_identity(path)
    fd, start = open_checked(path, identity)
    try:
        check_unchanged(fd, path, start)
        with open(path, "ab") as f:
            f.write(b"more")
        with pytest.raises(CheckpointError, match="changed while being read"):
            check_unchanged(fd, path, start)
    finally:
        os.close(fd)
    other = tmp_path / "g"
    other.write_bytes(b"y" * 100)
    os.replace(other, path)
    with pytest.raises(CheckpointError, match="changed since it was validated"):
        open_checked(path, identity)


@pytest.mark.parametrize("reader", ["plain", "parallel"])
def test_file_replaced_after_validation_is_refused_by_both_readers(ckpts, tmp_path, small_chunks, reader):
    new = shutil.copytree(ckpts[1], tmp_path / "new")
    identity = file_identity(new / "model.safetensors")
    shutil.copy(ckpts[0] / "model.safetensors", tmp_path / "other")
    os.replace(tmp_path / "other", new / "model.safetensors")
    read = (iter_safetensors_file(new / "model.safetensors", None, identity) if reader == "plain" else
            iter_safetensors_to_gpu(new / "model.safetensors", None, "cpu", identity))
    with pytest.raises(CheckpointError, match="changed since it was validated"):
        next(read)


@pytest.mark.parametrize("how", ["truncated", "same size"])
def test_file_rewritten_while_the_parallel_reader_reads_it_is_refused(ckpts, tmp_path, small_chunks, how):
    new = shutil.copytree(ckpts[1], tmp_path / "new")
    file = new / "model.safetensors"
    read = iter_safetensors_to_gpu(file, None, "cpu", file_identity(file))
    next(read)
    data = file.read_bytes()
    with open(file, "r+b") as f:
        f.truncate(len(data) // 3)
        if how == "same size":
            f.seek(0, 2)
            f.write(bytes(len(data) - len(data) // 3))
    with pytest.raises(CheckpointError, match="truncated while being read|changed while being read"):
        for _ in read:
            pass


# ---- the rollback point -----------------------------------------------------------------------------

def nan_in_a_late_layer(src, dst):
    tensors = dict(CheckpointReader(src).iter_tensors())
    tensors["model.layers.3.mlp.down_proj.weight"][0, 0] = float("nan")
    return write_checkpoint(dst, CheckpointReader(src).config, tensors)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_rollback_across_slab_boundaries_restores_bitwise(ckpts, tmp_path, monkeypatch, quantization):
    """Slabs smaller than most tensors: a saved tensor spans several, and still comes back whole."""
    monkeypatch.setattr(rollback, "SLAB_BYTES", 4096 + 8)
    a, b = ckpts
    engine = Engine(a, quantization=quantization)
    before = {k: v.clone() for k, v in kernel_tensors(engine.model).items()}
    with pytest.raises(UpdateError, match="layers were restored"):
        engine.update_weights_from_disk(nan_in_a_late_layer(b, tmp_path / "nan"))
    after = kernel_tensors(engine.model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine.update_weights_from_disk(b)
    assert_hot_equals_cold(engine, b, PROMPTS)


def test_host_store_packs_tensors_into_slabs(monkeypatch):
    monkeypatch.setattr(rollback, "SLAB_BYTES", 64)
    live = {"a": torch.randn(10), "b": torch.randn(40), "c": torch.arange(3, dtype=torch.int8)}
    store = rollback.HostStore(live, pin=False)
    assert store.total == 40 + 160 + 3 and len(store.slabs) == 4
    for name, t in live.items():
        pieces = store.pieces(name, t)
        for host, src in pieces:
            host.copy_(src)
        assert torch.equal(torch.cat([h for h, _ in pieces]), t.reshape(-1).view(torch.uint8))


# ---- GPU: the pinned path in the engine ---------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_ckpts(make_ckpt):
    return make_ckpt("small", seed=64, **GPU_SHAPE), make_ckpt("small", seed=65, **GPU_SHAPE)


@pytest.fixture(params=["own", "instanttensor"])
def disk_reader(request, monkeypatch):
    """Each GPU disk case runs through the engine's own reader and through InstantTensor
    (the optional package; the case is skipped, and says why, where it is not installed)."""
    if request.param == "instanttensor":
        why = instanttensor_reader.unavailable("cuda")
        if why:
            pytest.skip(why)
    monkeypatch.setenv("COURSE_LIB_DISK_READER", request.param)
    return request.param


def count_gpu_reads(monkeypatch, reader):
    """Spy on the reader ``reader`` names: a list that gets (device, identity) per call."""
    calls = []
    if reader == "own":
        real = checkpoint.iter_safetensors_to_gpu

        def spy(file, wanted, device, identity=None):
            calls.append((str(device), identity))
            return real(file, wanted, device, identity)
        monkeypatch.setattr(checkpoint, "iter_safetensors_to_gpu", spy)
    else:
        real_it = instanttensor_reader.iter_with_instanttensor

        def spy_it(files, wanted, device, identities):
            calls.append((str(device), identities.get(files[0])))
            return real_it(files, wanted, device, identities)
        monkeypatch.setattr(instanttensor_reader, "iter_with_instanttensor", spy_it)
    return calls


@pytest.mark.cuda
@pytest.mark.parametrize("quantization", [None, "int8", "fp8"], ids=["bf16", "int8", "fp8"])
def test_pinned_disk_update_is_hot_equals_cold_under_graphs(gpu_ckpts, monkeypatch, quantization, disk_reader):
    a, b = gpu_ckpts
    engine = Engine(a, device="cuda", quantization=quantization, enable_cuda_graph=True)
    calls = count_gpu_reads(monkeypatch, disk_reader)
    for target in (b, a, b):
        before = len(calls)
        engine.update_weights_from_disk(target)
        # One read per update (one file), with the validated identity (the cold engines below read too).
        assert len(calls) == before + 1 and calls[-1][1] is not None, calls
        assert_addresses_unchanged(engine)
        assert_hot_equals_cold(engine, target, PROMPTS, max_new_tokens=8)


@pytest.mark.cuda
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_nan_in_a_later_layer_on_the_gpu_restores_the_written_layers(gpu_ckpts, tmp_path, quantization,
                                                                     disk_reader):
    a, b = gpu_ckpts
    engine = Engine(a, device="cuda", quantization=quantization, enable_cuda_graph=True)
    engine.update_weights_from_disk(b)  # the pinned rollback slabs exist now: the reused ones are tested
    before = {k: v.clone() for k, v in kernel_tensors(engine.model).items()}
    with pytest.raises(UpdateError, match=r"after \d+ layers were written.*restored"):
        engine.update_weights_from_disk(nan_in_a_late_layer(a, tmp_path / "nan"))
    after = kernel_tensors(engine.model)
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    assert engine.health()["healthy"]
    assert_addresses_unchanged(engine)
    assert_hot_equals_cold(engine, b, PROMPTS, max_new_tokens=8)


@pytest.mark.cuda
def test_gpu_extra_memory_is_one_layer_plus_the_ring(gpu_ckpts, disk_reader):
    """torch's peak above the start: one layer plus the own reader's ring; through
    InstantTensor its ring is outside torch's counters, so torch sees one layer and the
    tensors InstantTensor hands out (their copies out of its ring)."""
    a, b = gpu_ckpts
    engine = Engine(a, device="cuda", enable_cuda_graph=True)
    engine.update_weights_from_disk(b)
    memory = engine.update_weights_from_disk(a)["memory"]
    meta = CheckpointReader(a).metadata()
    layers = {}
    for name, (shape, dtype) in meta.items():
        key = layer_key(name)
        layers[key] = layers.get(key, 0) + torch.Size(shape).numel() * dtype.itemsize
    bound = max(layers.values()) + 2 * pinned_reader.CHUNK_BYTES
    assert 0 < memory["gpu_peak_extra_bytes"] <= bound, (memory, max(layers.values()))
    if disk_reader == "instanttensor":
        assert 0 < instanttensor_reader.last_ring_bytes, "the ring's size is known (the benchmark adds it)"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_check_finite_on_the_gpu_one_pass_no_copy(dtype):
    big = torch.randn(4096, 4096, device="cuda").to(dtype)
    for value in (float("nan"), float("inf"), float("-inf")):
        bad = big.clone()
        bad[4000, 17] = value
        with pytest.raises(UpdateError, match="^bad:"):
            check_finite([("ok", big), ("bad", bad)])
        del bad
    big[0, 0] = torch.finfo(dtype).max
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    check_finite([("ok", big), ("also", big[:, :100])])
    assert torch.cuda.max_memory_allocated() - start < (1 << 20)  # the tensor is 16 MiB or more


@pytest.mark.cuda
def test_gpu_reader_refuses_a_file_replaced_after_validation(gpu_ckpts, tmp_path, disk_reader):
    a, b = gpu_ckpts
    new = shutil.copytree(b, tmp_path / "new")
    reader = CheckpointReader(new)
    reader.metadata()
    shutil.copy(a / "model.safetensors", tmp_path / "other")
    os.replace(tmp_path / "other", new / "model.safetensors")
    with pytest.raises(CheckpointError, match="changed since it was validated"):
        next(reader.iter_tensors(device="cuda"))


@pytest.mark.cuda
def test_instanttensor_reader_refuses_a_file_changed_while_it_is_read(gpu_ckpts, tmp_path, monkeypatch):
    """After the first tensor was handed out the file's modification time changes (as a
    rewrite in place changes it): the next tensor is refused, whatever InstantTensor read
    already. (The own reader checks once per segment: its case is on the CPU, above.)"""
    why = instanttensor_reader.unavailable("cuda")
    if why:
        pytest.skip(why)
    monkeypatch.setenv("COURSE_LIB_DISK_READER", "instanttensor")
    a, _ = gpu_ckpts
    new = shutil.copytree(a, tmp_path / "new")
    reader = CheckpointReader(new)
    reader.metadata()
    tensors = reader.iter_tensors(device="cuda")
    next(tensors)
    st = os.stat(new / "model.safetensors")
    os.utime(new / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(CheckpointError, match="changed while being read"):
        for _ in tensors:
            pass


def test_disk_reader_setting_and_fallback(monkeypatch):
    """The own reader by default; ``auto`` takes it where InstantTensor cannot read (a CPU
    device, or the package missing); asking for InstantTensor there is an error that says
    why; an unknown value is refused naming the variable."""
    from course_lib import settings
    monkeypatch.delenv("COURSE_LIB_DISK_READER", raising=False)
    assert settings.disk_reader() == "own"
    assert instanttensor_reader.reader_name("cuda") == "own"
    monkeypatch.setenv("COURSE_LIB_DISK_READER", "auto")
    assert instanttensor_reader.reader_name("cpu") == "own"
    monkeypatch.setenv("COURSE_LIB_DISK_READER", "own")
    assert instanttensor_reader.reader_name("cuda") == "own"
    monkeypatch.setenv("COURSE_LIB_DISK_READER", "instanttensor")
    with pytest.raises(CheckpointError, match="COURSE_LIB_DISK_READER=instanttensor, but InstantTensor reads to CUDA"):
        instanttensor_reader.reader_name("cpu")
    monkeypatch.setenv("COURSE_LIB_DISK_READER", "fastest")
    with pytest.raises(settings.SettingsError, match="COURSE_LIB_DISK_READER='fastest'"):
        settings.disk_reader()
