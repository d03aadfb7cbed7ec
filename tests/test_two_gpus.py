"""Two GPUs, NCCL between processes: a trainer on cuda:0 broadcasting into an engine on
cuda:1 step after step, and a serving engine on cuda:0 seeding a new engine on cuda:1.
Each ends hot == cold with the address audit clean. (TP=2 with CUDA graphs:
``tests/test_tp.py``. Resharding between a TP=2 trainer and an engine needs a GPU per
rank of the weight-update group, three at least: NCCL refuses two ranks on one GPU.)
Skipped with fewer than two GPUs; ``bash scripts/gpu_check.sh two-gpu`` runs them."""
import multiprocessing as mp
import shutil

import pytest
import torch

from course_lib import Engine
from course_lib.testing import assert_addresses_unchanged, assert_hot_equals_cold, serve_checkpoint
from course_lib.weights.checkpoint import CheckpointReader
from course_lib.weights.transports import trainer
from course_lib.weights.transports.dist import free_port

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL between processes)")]

PROMPTS = ["over NVLink", "from the other GPU"]
CTX = mp.get_context("spawn")
BUCKET_BYTES = 60_000


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    return make_ckpt("tiny", seed=71), make_ckpt("tiny", seed=72)


@pytest.fixture
def gpu1():
    """The engine under test lives on cuda:1, the current device meanwhile (streams,
    synchronisation and NCCL's communicator follow the current device)."""
    with torch.cuda.device(1):
        yield "cuda:1"


def test_trainer_broadcast_over_nccl_step_after_step(ckpts, gpu1):
    a, b = ckpts
    engine = Engine(a, device=gpu1)
    port, announcements, results = free_port(), CTX.Queue(), CTX.Queue()
    child = CTX.Process(target=trainer.push_broadcast, args=(b, port, announcements, BUCKET_BYTES),
                        kwargs={"results": results, "backend": "nccl", "device": "cuda:0", "rounds": 3})
    child.start()
    assert engine.init_weights_update_group("127.0.0.1", port, 1, 2, backend="nccl")["success"]
    cache = engine.updater.transfers.buckets
    buckets = 0
    for step in range(3):
        if step:
            engine.update_weights_from_disk(a)  # the old weights again: the broadcast must bring B back
        engine.pause_generation("abort")
        buckets = 0
        while (request := announcements.get(timeout=120)) is not None:
            assert engine.update_weights_from_distributed(**request, flush_cache=False)["success"]
            buckets += 1
        engine.continue_generation()
        assert_hot_equals_cold(engine, b, PROMPTS)
        stats = results.get(timeout=120)
        assert stats["buckets"] == buckets > 2 and stats["bytes"] >= CheckpointReader(b).nbytes()
    assert trainer.wait_for_exit(child) == 0
    # Each layout received into the same buffer every step: its copy table built once.
    assert cache.stats["tables_built"] == buckets and cache.stats["table_hits"] == 2 * buckets
    assert_addresses_unchanged(engine)
    engine.destroy_weights_update_group()
    assert not engine.updater.transfers.receive_pools


def test_remote_seeding_over_nccl(ckpts, gpu1, tmp_path):
    a, _ = ckpts
    shutil.copy(a / "config.json", tmp_path / "config.json")
    port, results = free_port(), CTX.Queue()
    child = CTX.Process(target=serve_checkpoint, args=(a, port, results),
                        kwargs={"bucket_bytes": BUCKET_BYTES, "device": "cuda:0"})
    child.start()
    engine = Engine(tmp_path, load_format="dummy", device=gpu1)
    result = engine.receive_weights_from_remote("127.0.0.1", port, backend="nccl", timeout_s=120)
    stats = results.get(timeout=120)
    assert trainer.wait_for_exit(child) == 0
    assert "error" not in stats, stats
    assert stats["buckets"] > 2 and result["bytes"] == CheckpointReader(a).nbytes()
    assert engine.health()["ready"] is True
    assert_hot_equals_cold(engine, a, PROMPTS)
    assert_addresses_unchanged(engine)
