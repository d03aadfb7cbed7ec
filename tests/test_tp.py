"""Tensor parallelism: a TP=2 engine (rank 0 here, rank 1 a spawned process, gloo on CPU)
computes what a TP=1 engine computes, and every hot update reaches every rank.

Logits are compared with a tolerance: each rank multiplies by half of a weight and the
all-reduce adds the halves, so the sums run in another order than on one rank and the
last bits may differ (measured: about 2e-6 on logits of order 1; the bound is 2e-5).
Greedy tokens must be equal. Per rank, hot == cold is bitwise.
"""
import pytest
import torch

from course_lib import Engine
from course_lib.weights.checkpoint.model_loader import load_model
from course_lib.engine.pause import EngineBusyError
from course_lib.engine.tp import TPEngine
from course_lib.testing import greedy_tokens, prompt_logits
from course_lib.weights.checkpoint import CheckpointReader
from course_lib.weights.commit.validate import UpdateError

PROMPTS = ["split across ranks", "two halves make a whole"]
ATOL = 2e-5


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    return make_ckpt("tiny", seed=61), make_ckpt("tiny", seed=62)


@pytest.fixture(scope="module")
def engine(ckpts):
    eng = TPEngine(ckpts[0], tensor_parallel_size=2)
    eng.update_weight_version("a")
    yield eng
    assert eng.close() == [0]  # the worker left cleanly
    assert not torch.distributed.is_initialized()  # and so did rank 0: no group left behind


@pytest.fixture
def on_a(engine, ckpts):
    """Each test starts from checkpoint A with nothing in flight, and leaves it so."""
    yield engine
    if engine.paused:
        engine.continue_generation()
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # hand back anything still pending
    engine.update_weights_from_disk(ckpts[0], weight_version="a")


def assert_ranks_equal_cold(engine, path):
    for rank in range(2):
        cold = load_model(CheckpointReader(path), "cpu", torch.float32, rank, 2).state_dict()
        hot = engine.rank_parameters(rank)
        assert set(hot) == set(cold)
        for name in cold:
            assert torch.equal(hot[name], cold[name]), f"rank {rank}: {name} differs from a cold start"


def assert_matches_tp1(engine, path):
    one = Engine(path)
    for prompt in PROMPTS:
        ids = one.tokenizer.encode(prompt)
        torch.testing.assert_close(prompt_logits(engine, ids), prompt_logits(one, ids), atol=ATOL, rtol=0)
    assert greedy_tokens(engine, PROMPTS, 12) == greedy_tokens(one, PROMPTS, 12)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for tensor_parallel_size=2 (NCCL)")
def test_tp2_on_two_gpus_with_nccl_and_cuda_graphs(ckpts):
    """First in the file: the CPU engine below owns this process's default group until
    the module ends. NCCL collectives captured inside each rank's CUDA graphs; float32 so TP=1 and TP=2
    can be compared with the same tolerance as on CPU (loosened for GPU kernels)."""
    a, b = ckpts
    one_a = Engine(a, device="cuda", dtype="float32")
    with TPEngine(a, tensor_parallel_size=2, device="cuda", dtype="float32") as eng:
        assert eng.model_runner.graphs, "CUDA graphs were not captured"
        ids = one_a.tokenizer.encode(PROMPTS[0])
        torch.testing.assert_close(prompt_logits(eng, ids), prompt_logits(one_a, ids), atol=1e-3, rtol=0)
        assert greedy_tokens(eng, PROMPTS) == greedy_tokens(one_a, PROMPTS)
        eng.update_weights_from_disk(b, weight_version="b")
        eng.verify_addresses_on_every_rank()
        for rank in range(2):
            cold = load_model(CheckpointReader(b), f"cuda:{rank}", torch.float32, rank, 2).state_dict()
            hot = eng.rank_parameters(rank)
            assert all(torch.equal(hot[k], cold[k].cpu()) for k in cold), rank
        # The graphs replay the new weights: decode equals a TP=1 engine cold on B.
        assert greedy_tokens(eng, PROMPTS) == greedy_tokens(Engine(b, device="cuda", dtype="float32"), PROMPTS)
    # Closed cleanly: the worker left the group and exited, and so did this process.
    assert eng.close() == [0] and not torch.distributed.is_initialized()


def test_each_rank_holds_only_its_slices(on_a, ckpts):
    assert_ranks_equal_cold(on_a, ckpts[0])
    q = on_a.rank_parameters(1)["model.layers.0.self_attn.qkv_proj.weight"]
    config = on_a.model_config
    assert q.shape[0] == (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim // 2


def test_tp2_computes_what_tp1_computes(on_a, ckpts):
    assert_matches_tp1(on_a, ckpts[0])
    # Batched decode through the same scheduler: several requests at once.
    outs = on_a.generate(PROMPTS * 2, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert [o["output_ids"] for o in outs[:2]] == [o["output_ids"] for o in outs[2:]]


def test_update_from_disk_reaches_every_rank(on_a, ckpts):
    result = on_a.update_weights_from_disk(ckpts[1], weight_version="b")
    assert result["success"] and on_a.get_weight_version() == "b"
    assert_ranks_equal_cold(on_a, ckpts[1])
    assert_matches_tp1(on_a, ckpts[1])
    on_a.verify_addresses_on_every_rank()


def test_update_from_tensors_reaches_every_rank(on_a, ckpts):
    tensors = list(CheckpointReader(ckpts[1]).iter_tensors())
    on_a.update_weights_from_tensor(tensors[:9])
    on_a.update_weights_from_tensor(tensors[9:], weight_version="b")
    assert_ranks_equal_cold(on_a, ckpts[1])


def test_wait_mode_drains_on_the_old_weights_with_every_rank(on_a, ckpts):
    """In wait mode rank 0 finishes its requests (the workers still take part in every
    forward) before any rank's weights change."""
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    rids = [on_a.add_request(p, params) for p in PROMPTS]
    on_a.step()
    on_a.step()
    on_a.pause_generation("wait")
    on_a.update_weights_from_disk(ckpts[1], weight_version="b")
    on_a.continue_generation()
    done = {o["rid"]: o for o in on_a.step()}
    assert set(done) == set(rids)
    expected = greedy_tokens(Engine(ckpts[0]), PROMPTS, 10)
    assert [done[r]["output_ids"] for r in rids] == expected
    assert all(done[r]["meta_info"]["weight_versions"] == [{"version": "a", "start": 0, "end": 10}] for r in rids)
    assert_ranks_equal_cold(on_a, ckpts[1])


def test_one_call_pauses_on_rank_0_updates_every_rank_and_continues(on_a, ckpts):
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    rids = [on_a.add_request(p, params) for p in PROMPTS]
    on_a.step()
    result = on_a.update_weights_from_disk(ckpts[1], weight_version="b", pause_mode="retract")
    assert not on_a.paused and "pause" in result["timings_ms"] and "continue" in result["timings_ms"]
    assert_ranks_equal_cold(on_a, ckpts[1])
    done = set()
    while on_a.has_unfinished_requests():
        done |= {o["rid"] for o in on_a.step()}
    assert done == set(rids)


def test_busy_engine_refuses_and_no_rank_changes(on_a, ckpts):
    before = on_a.rank_parameters(1)
    on_a.add_request(PROMPTS[0], {"max_new_tokens": 4})
    with pytest.raises(EngineBusyError):
        on_a.update_weights_from_disk(ckpts[1])
    after = on_a.rank_parameters(1)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_bad_checkpoint_is_refused_on_every_rank(on_a, ckpts, tmp_path):
    with pytest.raises(UpdateError, match="no such checkpoint"):
        on_a.update_weights_from_disk(tmp_path / "missing")
    assert on_a.health()["healthy"]
    assert_ranks_equal_cold(on_a, ckpts[0])


def test_snapshot_and_rollback_on_every_rank(on_a, ckpts):
    on_a.take_snapshot()
    on_a.update_weights_from_disk(ckpts[1], weight_version="b")
    on_a.rollback()
    assert on_a.get_weight_version() == "a"
    assert_ranks_equal_cold(on_a, ckpts[0])


def _broadcast_from_a_trainer(engine, path, each_bucket):
    """A trainer process (group rank 0) broadcasts ``path`` to both engine ranks (group
    ranks 1 and 2); ``each_bucket(request)`` is called per announced bucket."""
    import multiprocessing as mp

    from course_lib.weights.transports import trainer
    from course_lib.weights.transports.dist import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    announcements = ctx.Queue()
    child = ctx.Process(target=trainer.push_broadcast, args=(path, port, announcements, 60_000),
                        kwargs={"world_size": 3})
    child.start()
    assert engine.init_weights_update_group("127.0.0.1", port, 1, 3, "weight_update_group", "gloo")["success"]
    try:
        buckets = 0
        while (request := announcements.get(timeout=60)) is not None:
            each_bucket(request)
            buckets += 1
        assert trainer.wait_for_exit(child) == 0  # the trainer finished: every rank took every bucket
    finally:
        engine.destroy_weights_update_group()
    return buckets


def test_broadcast_from_a_trainer_reaches_every_rank(on_a, ckpts):
    """SGLang's way: every rank takes the full broadcast, its loaders keep its slice."""
    a, b = ckpts
    on_a.pause_generation("abort")
    buckets = _broadcast_from_a_trainer(
        on_a, b, lambda request: on_a.update_weights_from_distributed(**request, weight_version="b"))
    on_a.continue_generation()
    assert buckets > 2
    assert on_a.get_weight_version() == "b"
    assert_ranks_equal_cold(on_a, b)
    assert_matches_tp1(on_a, b)


def test_busy_engine_refuses_a_broadcast_on_every_rank_and_still_drains_it(on_a, ckpts):
    before = on_a.rank_parameters(1)
    on_a.add_request(PROMPTS[0], {"max_new_tokens": 4})
    refusals = []

    def refused(request):
        with pytest.raises(EngineBusyError, match="not paused"):
            on_a.update_weights_from_distributed(**request)
        refusals.append(1)
    _broadcast_from_a_trainer(on_a, ckpts[1], refused)
    assert refusals and on_a.health()["healthy"]
    after = on_a.rank_parameters(1)
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_heads_must_divide_before_any_process_starts(make_ckpt):
    path = make_ckpt("tiny", seed=63)  # 2 KV heads
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\) is not divisible by tensor_parallel_size \(4\)"):
        TPEngine(path, tensor_parallel_size=4)
