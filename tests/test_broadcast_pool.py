"""A trainer's broadcast step after step: the engine receives each announced layout into
the same buffer every step (``dist.ReceivePool``) and writes it through one copy table
built once (``weights/commit/bucket_cache.py``); hot == cold each step, refusals change nothing,
and the buffers go when the group does. Real gloo groups, the trainer a thread here."""
import queue
import threading

import pytest
import torch

from course_lib import Engine
from course_lib.engine.pause import EngineBusyError
from course_lib.testing import assert_addresses_unchanged, assert_hot_equals_cold
from course_lib.weights.checkpoint import CheckpointReader
from course_lib.weights.transports import dist
from course_lib.weights.commit.validate import UpdateError

PROMPTS = ["the same buffers", "every step"]
BUCKET_BYTES = 60_000


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    return make_ckpt("tiny", seed=41), make_ckpt("tiny", seed=42)


def start_trainer(rounds: list[list[tuple[str, torch.Tensor]]], bucket_bytes: int = BUCKET_BYTES,
                  device: str = "cpu"):
    """Rank 0 on a thread: broadcast each round's tensors (packed on ``device``; gloo
    carries CUDA tensors too), announcing each bucket (then None) on the queue it returns.
    Returns (port, announcements, thread, errors)."""
    port, announcements, errors = dist.free_port(), queue.Queue(), []

    def run():
        try:
            sender = dist.WeightBroadcaster("127.0.0.1", port, 2, "weight_update_group", "gloo", device, bucket_bytes)
            for tensors in rounds:
                sender.broadcast(tensors, announcements.put)
                announcements.put(None)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            announcements.put(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return port, announcements, thread, errors


def receive_round(engine, announcements, **kwargs) -> list:
    """Every bucket of one round; returns each call's result (or the exception it raised)."""
    out = []
    while (request := announcements.get(timeout=60)) is not None:
        try:
            out.append(engine.update_weights_from_distributed(**request, flush_cache=False, **kwargs))
        except (UpdateError, EngineBusyError) as exc:
            out.append(exc)
    return out


def params(engine):
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


def two_buckets(tensors) -> int:
    """A bucket size that splits ``tensors`` into exactly two buckets."""
    total = sum(t.numel() * t.element_size() + 64 for _, t in tensors)
    for size in range(total // 2, total, 1024):
        if len(dist.bucket_plan(tensors, size)) == 2:
            return size
    raise AssertionError("no bucket size gives two buckets")


@pytest.mark.parametrize("layout,device", [("many buckets", "cpu"), ("two buckets", "cpu"),
                                           pytest.param("many buckets", "cuda", marks=pytest.mark.cuda)])
def test_each_layout_lands_in_the_same_buffer_and_table_every_step(ckpts, layout, device):
    """Two buckets per step: each buffer carries one bucket a step, which the release at
    resume would drop from a trainer's mappings; the engine's own buffers stay. On a GPU
    the buckets arrive in GPU memory and each is one scatter copy."""
    a, b = ckpts
    new = [(n, t.to(device)) for n, t in CheckpointReader(b).iter_tensors()]
    engine = Engine(a, device=device)
    size = BUCKET_BYTES if layout == "many buckets" else two_buckets(new)
    port, announcements, thread, errors = start_trainer([new, new, new], size, device)
    engine.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo")
    cache = engine.updater.transfers.buckets
    engine.pause_generation("abort")
    first = receive_round(engine, announcements)
    buckets = len(first)
    assert (buckets > 2 if layout == "many buckets" else buckets == 2) and all(r["success"] for r in first)
    assert cache.stats["tables_built"] == buckets and cache.stats["table_hits"] == 0
    pool = engine.updater.transfers.receive_pools["weight_update_group"]
    held = pool.nbytes
    assert 0 < held <= 2 * max(size, max(t.numel() * t.element_size() for _, t in new))
    engine.continue_generation()
    engine.updater.transfers.release()  # what resuming does on a GPU: trainers' one-off buffers go
    assert_hot_equals_cold(engine, b, PROMPTS)
    assert pool.buffers[0].device.type == device
    for _ in range(2):  # back to the old weights, then the broadcast again: every bucket a table hit
        engine.update_weights_from_disk(a)
        engine.pause_generation("abort")
        again = receive_round(engine, announcements)
        assert len(again) == buckets and all(r["success"] for r in again)
        engine.continue_generation()
        engine.updater.transfers.release()
        assert_hot_equals_cold(engine, b, PROMPTS)
    thread.join(60)
    assert not errors
    assert cache.stats["tables_built"] == buckets and cache.stats["table_hits"] == 2 * buckets
    assert pool.nbytes == held  # no buffer grew or was added
    assert_addresses_unchanged(engine)
    engine.destroy_weights_update_group()
    assert not engine.updater.transfers.receive_pools and not cache.resident and cache.num_buffers == 0


def test_a_refused_bucket_writes_nothing_and_the_next_step_applies(ckpts):
    """check_finite refuses a bucket whose bytes landed in a pooled buffer with a table:
    nothing written; the same layout, clean, applies from the same buffer next step."""
    a, b = ckpts
    new = list(CheckpointReader(b).iter_tensors())
    poisoned = [(n, t.clone()) for n, t in new]
    name, tensor = poisoned[-1]
    tensor.view(-1)[0] = float("nan")
    engine = Engine(a)
    port, announcements, thread, errors = start_trainer([new, poisoned, new])
    engine.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo")
    engine.pause_generation("abort")
    assert all(r["success"] for r in receive_round(engine, announcements, check_finite=True))
    engine.update_weights_from_disk(a)
    before = params(engine)
    count = engine.weight_update_count
    second = receive_round(engine, announcements, check_finite=True)
    refused = [r for r in second if isinstance(r, Exception)]
    assert len(refused) == 1 and name in str(refused[0])
    after = params(engine)
    assert torch.equal(after[name], before[name])  # the refused bucket's tensors are the old ones
    assert engine.weight_update_count == count + len(second) - 1
    third = receive_round(engine, announcements, check_finite=True)
    assert all(r["success"] for r in third)
    engine.continue_generation()
    thread.join(60)
    assert not errors
    assert_hot_equals_cold(engine, b, PROMPTS)
    assert_addresses_unchanged(engine)
    engine.destroy_weights_update_group()


def test_a_refused_update_still_receives_and_keeps_no_buffer(ckpts):
    """A busy engine refuses, yet takes the bytes (the trainer never hangs); a refusal goes
    through fresh memory, so the pool is not even created."""
    a, b = ckpts
    new = list(CheckpointReader(b).iter_tensors())
    engine = Engine(a)
    engine.add_request("still generating", {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True})
    engine.step()
    before = params(engine)
    port, announcements, thread, errors = start_trainer([new])
    engine.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo")
    results = receive_round(engine, announcements)
    thread.join(60)
    assert not errors and results and all(isinstance(r, EngineBusyError) for r in results)
    after = params(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert "weight_update_group" not in engine.updater.transfers.receive_pools
    engine.destroy_weights_update_group()


def test_pool_gives_each_layout_one_slot_and_grows_a_buffer_for_a_larger_bucket():
    pool = dist.ReceivePool("cpu", num_buffers=2)
    f32 = [torch.float32]
    sx, x, meta_x, _ = pool.buffer_for(["x"], f32, [[4]])
    sy, y, _, _ = pool.buffer_for(["y"], f32, [[4]])
    assert (sx, sy) == (0, 1) and x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()  # in turn
    sx2, x2, meta_x2, replaced = pool.buffer_for(["x"], f32, [[4]])
    assert sx2 == 0 and replaced is None and x2.data_ptr() == x.data_ptr() and meta_x2 is meta_x
    sz, big, meta_big, replaced = pool.buffer_for(["z"], f32, [[1000]])  # slot 0 again, larger
    assert sz == 0 and replaced is not None and replaced.data_ptr() == x.untyped_storage().data_ptr()
    assert big.numel() == meta_big[-1].end_idx == 4000
    storages = pool.clear()
    assert len(storages) == 2 and pool.nbytes == 0 and not pool.layouts


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_steps_back_to_back_each_land_whole(ckpts, device):
    """Round after round with no pause between them (on a GPU: the next bucket received
    while the last is still copied, nothing waited for on the host): after each round the
    weights are exactly the ones that round sent, bucket for bucket."""
    a, b = ckpts
    sent = {p: [(n, t.to(device)) for n, t in CheckpointReader(p).iter_tensors()] for p in (a, b)}
    expected = {p: params(Engine(p, device=device)) for p in (a, b)}
    order = [b, a, b, a, b]
    engine = Engine(a, device=device)
    port, announcements, thread, errors = start_trainer([sent[p] for p in order], BUCKET_BYTES // 3, device)
    engine.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo")
    engine.pause_generation("abort")
    for p in order:
        results = receive_round(engine, announcements)
        assert len(results) > 6 and all(r["success"] for r in results)
        now = params(engine)
        assert all(torch.equal(now[k], expected[p][k]) for k in now), f"round from {p} did not land whole"
    thread.join(60)
    assert not errors
    engine.continue_generation()
    assert_hot_equals_cold(engine, b, PROMPTS)
    engine.destroy_weights_update_group()
