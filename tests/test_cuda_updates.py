"""GPU: hot updates under CUDA graphs for bf16, int8 and fp8; real CUDA IPC from another
process; the rebinding bug on a real captured graph, and the audit catching it."""
import multiprocessing as mp

import pytest
import torch

from course_lib import Engine
from course_lib.layers.quant import kernel_tensors
from course_lib.testing import GPU_TEST_SHAPE, assert_addresses_unchanged, assert_hot_equals_cold
from course_lib.weights.commit.audit import AddressMovedError
from course_lib.weights.transports import trainer

pytestmark = pytest.mark.cuda
PROMPTS = ["graphs remember addresses", "x" * 40, "hot equals cold on the GPU"]
GPU_SHAPE = GPU_TEST_SHAPE


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    return make_ckpt("small", seed=51, **GPU_SHAPE), make_ckpt("small", seed=52, **GPU_SHAPE)


@pytest.mark.parametrize("quantization", [None, "int8", "fp8"], ids=["bf16", "int8", "fp8"])
def test_graphs_and_updates_hot_equals_cold(ckpts, quantization):
    a, b = ckpts
    engine = Engine(a, device="cuda", quantization=quantization, enable_cuda_graph=True)
    assert engine.model_runner.graphs
    for target in (b, b, a):  # twice in a row, then back
        result = engine.update_weights_from_disk(target)
        assert result["memory"]["gpu_peak_extra_bytes"] >= 0
        assert_addresses_unchanged(engine)
        assert_hot_equals_cold(engine, target, PROMPTS, max_new_tokens=12)
    print(f"\n{quantization or 'bf16'}: peak extra GPU memory per update "
          f"{result['memory']['gpu_peak_extra_bytes'] / 2**20:.2f} MiB, held {result['memory']['peak_held_bytes'] / 2**20:.2f} MiB")


def test_cuda_ipc_from_another_process(ckpts):
    a, b = ckpts
    ctx = mp.get_context("spawn")
    engine = Engine(a, device="cuda", enable_cuda_graph=True)
    payloads, acks = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=trainer.push_ipc, args=(b, payloads, acks, 1 << 20, "cuda"))
    child.start()
    engine.pause_generation("retract")
    n = 0
    while (item := payloads.get(timeout=120)) is not None:
        receipt, payload = item
        engine.update_weights_from_tensor(payload, load_format="flattened_bucket", flush_cache=False)
        acks.put(receipt)
        n += 1
    assert trainer.wait_for_exit(child) == 0 and n > 1
    engine.flush_cache()
    engine.continue_generation()
    assert_addresses_unchanged(engine)
    assert_hot_equals_cold(engine, b, PROMPTS, max_new_tokens=12)


def test_rebinding_is_invisible_to_a_captured_graph_and_the_audit_catches_it(ckpts):
    a, b = ckpts
    engine = Engine(a, device="cuda", enable_cuda_graph=True)
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    before = [o["output_ids"] for o in engine.generate(PROMPTS, params)]
    cold_b = [o["output_ids"] for o in Engine(b, device="cuda", enable_cuda_graph=True).generate(PROMPTS, params)]
    # The bug: rebind every parameter to new memory holding B's values.
    fresh = Engine(b, device="cuda", enable_cuda_graph=False)
    new = kernel_tensors(fresh.model)
    for name, p in engine.model.named_parameters():
        if name in new:
            p.data = new[name].clone()
    after = [o["output_ids"] for o in engine.generate(PROMPTS, params)]
    # Decode replays graphs that still read A's memory; prefill (eager) reads B: a silent mix.
    assert after != cold_b
    with pytest.raises(AddressMovedError, match="data_ptr changed"):
        engine.verify_addresses()
    assert before  # the engine did serve before the bug


@pytest.mark.parametrize("disk_reader", ["own", "instanttensor"])
def test_pinned_reader_reads_exactly_what_the_cpu_reader_reads(make_ckpt, monkeypatch, disk_reader):
    from course_lib.weights.checkpoint import instanttensor_reader, pinned_reader
    from course_lib.weights.checkpoint import CheckpointReader
    if disk_reader == "instanttensor" and instanttensor_reader.unavailable("cuda"):
        pytest.skip(instanttensor_reader.unavailable("cuda"))
    monkeypatch.setenv("COURSE_LIB_DISK_READER", disk_reader)
    monkeypatch.setattr(pinned_reader, "CHUNK_BYTES", 4096)  # every tensor spans several chunks
    ckpt = make_ckpt("small", seed=53, max_shard_size=200_000, torch_dtype="bfloat16")
    reader = CheckpointReader(ckpt)
    cpu = dict(reader.iter_tensors())
    gpu = dict(reader.iter_tensors(device="cuda"))
    assert cpu.keys() == gpu.keys()
    for name, t in cpu.items():
        assert gpu[name].is_cuda and gpu[name].dtype == t.dtype and torch.equal(gpu[name].cpu(), t), name


@pytest.mark.parametrize("source", ["cuda", "cpu"])
def test_copy_plan_on_the_gpu_writes_what_the_loaders_write(ckpts, monkeypatch, source):
    """Grouped device copies (and host-to-device copies straight into the weights) put
    the same bytes in the same memory as the per-tensor loaders, graphs replaying them."""
    from course_lib.weights.checkpoint import CheckpointReader
    a, b = ckpts
    new = [(n, t.to(source)) for n, t in CheckpointReader(b).iter_tensors()]
    states = {}
    for plan in ("1", "0"):
        monkeypatch.setenv("COURSE_LIB_COPY_PLAN", plan)
        engine = Engine(a, device="cuda", enable_cuda_graph=True)
        engine.update_weights_from_tensor(new)
        assert_addresses_unchanged(engine)
        assert_hot_equals_cold(engine, b, PROMPTS)
        states[plan] = {k: v.clone() for k, v in engine.model.state_dict().items()}
    assert all(torch.equal(v, states["0"][k]) for k, v in states["1"].items())
