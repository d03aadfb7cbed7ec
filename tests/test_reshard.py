"""Resharding: the planner (by hand on the 4x4 example, then coverage on random layouts),
the executor over a real gloo group, and a whole model moved from a trainer layout into a
tensor-parallel engine, ending hot == cold on every rank."""
import queue
import random
import threading

import pytest
import torch

from course_lib import Engine
from course_lib.engine.engine import load_model
from course_lib.engine.pause import EngineBusyError
from course_lib.engine.tp import TPEngine
from course_lib.layers.quant import process_weights_after_loading
from course_lib.testing import greedy_tokens, prompt_logits, random_partition
from course_lib.weights import reshard as R
from course_lib.weights.checkpoint import CheckpointReader, hf_tensor_shapes, preset
from course_lib.weights.transports.dist import new_group
from course_lib.weights.transports.dist import free_port

F32 = torch.float32


def four_by_four_plan():
    # Training holds columns, inference needs rows.
    return R.plan({"w": ((4, 4), F32)}, {"w": {"kind": "columns", "world_size": 2}},
                  {"w": {"kind": "rows", "world_size": 2}})


# ---- the 4x4 example, by hand ----------------------------------------------------------------

def test_four_by_four_plan_is_exactly_the_hand_made_one():
    p = four_by_four_plan()
    got = [(x.src, x.dst, x.region, x.src_box, x.dst_box, x.nbytes) for x in p.pieces]
    # Engine rank 0 needs rows 0:2: their left half from trainer 0, their right half from
    # trainer 1, placed side by side. Each piece is 2x2 float32 = 16 bytes.
    assert got == [
        (0, 0, ((0, 2), (0, 2)), ((0, 2), (0, 2)), ((0, 2), (0, 2)), 16),
        (1, 0, ((0, 2), (2, 4)), ((0, 2), (0, 2)), ((0, 2), (2, 4)), 16),
        (0, 1, ((2, 4), (0, 2)), ((2, 4), (0, 2)), ((0, 2), (0, 2)), 16),
        (1, 1, ((2, 4), (2, 4)), ((2, 4), (0, 2)), ((0, 2), (2, 4)), 16),
    ]
    assert [p.bytes_sent(t) for t in range(2)] == [32, 32]
    assert [p.bytes_received(e) for e in range(2)] == [32, 32] and p.total_bytes == 64
    text = p.summary(pieces=True)
    assert "engine rank 0: receives           32 B in 2 pieces from trainer ranks [0, 1]" in text
    assert "w [0:2, 2:4] from trainer 1 [0:2, 0:2] -> [0:2, 2:4] (16 B)" in text
    assert text.endswith("total: 64 B")


def test_four_by_four_moves_row_one_two_three_four_to_engine_rank_0():
    p = four_by_four_plan()
    full = torch.arange(1, 17, dtype=F32).view(4, 4)
    locals_ = [R.trainer_locals({"w": full}, p, t) for t in range(2)]
    assert locals_[0]["w"][0].tolist() == [1, 2] and locals_[1]["w"][0].tolist() == [3, 4]
    shards = R.reshard_in_memory(p, locals_)
    assert shards[0]["w"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert shards[1]["w"].tolist() == [[9, 10, 11, 12], [13, 14, 15, 16]]


def test_four_by_four_over_a_gloo_group_of_four():
    """Two trainer ranks and two engine ranks in one gloo world (threads of this process,
    each with its own group object); each engine rank allocates only its two rows."""
    p = four_by_four_plan()
    full = torch.arange(1, 17, dtype=F32).view(4, 4)
    port, out, errors = free_port(), {}, []

    def rank_main(rank):
        try:
            group, store = new_group("127.0.0.1", port, rank, 4, "reshard-4x4", "gloo", timeout_s=30)
            if rank < 2:
                out[rank] = R.send_pieces(p, rank, R.trainer_locals({"w": full}, p, rank), group)
            else:
                out[rank] = R.receive_shards(p, rank - 2, group)
            out[f"keep{rank}"] = (group, store)
        except Exception as exc:  # surfaced below, with the rank
            errors.append((rank, exc))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert out[0] == out[1] == {"pieces": 2, "bytes": 32}
    assert out[2]["w"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]] and out[2]["w"].shape == (2, 4)
    assert out[3]["w"].tolist() == [[9, 10, 11, 12], [13, 14, 15, 16]]


# ---- coverage on random shapes and layouts ----------------------------------------------------

def random_layout(rng: random.Random, shape, world: int, allow_replicas: bool):
    kinds = ["split", "explicit"] + (["replicated", "replicas"] if allow_replicas else [])
    kind = rng.choice(kinds)
    if kind == "split":
        return R.Layout.split(shape, world, rng.randrange(len(shape)))
    if kind == "replicated":
        return R.Layout.replicated(shape, world)
    if kind == "replicas" and world % 2 == 0 and world > 2:  # TP x DP: two copies of each shard
        half = random_partition(rng, shape, world // 2)
        return R.Layout.explicit(shape, half + half)
    return R.Layout.explicit(shape, random_partition(rng, shape, world))


@pytest.mark.parametrize("trainers,engines", [(2, 2), (2, 1), (1, 2), (4, 2)])
def test_every_destination_element_arrives_exactly_once(trainers, engines):
    rng = random.Random(1000 * trainers + engines)
    for _ in range(40):
        ndim = rng.choice([1, 2, 2, 3])
        shape = tuple(rng.randint(4, 9) for _ in range(ndim))
        src = random_layout(rng, shape, trainers, allow_replicas=True)
        dst = random_layout(rng, shape, engines, allow_replicas=engines > 1)
        p = R.plan({"t": (shape, F32)}, {"t": src}, {"t": dst})
        full = torch.randn(shape)
        for e, want in enumerate(dst.boxes):
            # Brute force: count how often each element of e's shard is delivered.
            count = torch.zeros(shape, dtype=torch.int64)
            for piece in p.pieces_for(e):
                assert R.intersect(piece.region, src.boxes[piece.src]) == piece.region
                count[R.box_slices(piece.region)] += 1
            inside = torch.zeros(shape, dtype=torch.bool)
            inside[R.box_slices(want)] = True
            assert (count[inside] == 1).all() and (count[~inside] == 0).all(), (src, dst)
            # Nothing beyond the shard: an engine rank receives exactly its own bytes.
            assert p.bytes_received(e) == R.volume(want) * 4
        assert sum(p.bytes_sent(t) for t in range(trainers)) == p.total_bytes
        locals_ = [R.trainer_locals({"t": full}, p, t) for t in range(trainers)]
        for e, shard in enumerate(R.reshard_in_memory(p, locals_)):
            assert torch.equal(shard["t"], full[R.box_slices(dst.boxes[e])])


def test_replicas_share_the_sending():
    """Four trainer ranks as two data-parallel copies of a 2-way split: both copies send."""
    shape = (8, 6)
    halves = R.Layout.split(shape, 2, 1).boxes
    p = R.plan({"w": (shape, F32)}, {"w": R.Layout.explicit(shape, halves + halves)},
               {"w": {"kind": "rows", "world_size": 2}})
    assert sorted({x.src for x in p.pieces_for(0)}) == [0, 1]
    assert sorted({x.src for x in p.pieces_for(1)}) == [2, 3]


def test_check_catches_a_missing_or_doubled_piece():
    p = four_by_four_plan()
    t = p.tensors["w"]
    dropped, doubled = t.pieces[:-1], t.pieces + t.pieces[:1]
    for broken in (dropped, doubled):
        t.pieces = broken
        with pytest.raises(R.ReshardError, match="engine rank"):
            p.check()


@pytest.mark.parametrize("boxes,match", [
    ([((0, 3), (0, 4)), ((2, 4), (0, 4))], "overlap"),
    ([((0, 2), (0, 4)), ((3, 4), (0, 4))], "do not cover"),
    ([((0, 2), (0, 4)), ((2, 5), (0, 4))], "outside"),
])
def test_bad_trainer_layouts_are_refused(boxes, match):
    with pytest.raises(R.ReshardError, match=match):
        R.plan({"w": ((4, 4), F32)}, {"w": R.Layout.explicit((4, 4), boxes)}, {"w": {"kind": "rows", "world_size": 2}})


def test_unknown_kind_and_disagreeing_world_sizes_are_refused():
    with pytest.raises(R.ReshardError, match="unknown layout kind"):
        R.Layout.from_spec({"kind": "diagonal", "world_size": 2}, (4, 4))
    tensors = {"a": ((4, 4), F32), "b": ((4,), F32)}
    with pytest.raises(R.ReshardError, match="disagree"):
        R.plan(tensors, {"a": {"kind": "rows", "world_size": 2}, "b": {"kind": "rows", "world_size": 4}},
               {n: {"kind": "replicated", "world_size": 1} for n in tensors})


def test_planning_an_8b_model_needs_no_memory():
    """The engine layouts come from a model on the meta device, so a plan for an 8B model
    (here: a 4-way trainer into an 8-way engine) takes no weight memory."""
    config = preset("qwen3-8b")
    p = R.plan_for_model(config, R.transposed_layouts(config, 4), tp_size=8)
    shards = [sum(R.volume(t.dest.boxes[e]) for t in p.tensors.values()) * 2 for e in range(8)]
    assert [p.bytes_received(e) for e in range(8)] == shards
    model_bytes = sum(torch.Size(s).numel() * 2 for s in hf_tensor_shapes(config).values())
    assert shards[0] < model_bytes / 7  # about 1/8 of the model (norms are replicated)
    assert "engine rank 7: receives" in p.summary()


# ---- the engine's layout equals what its loaders cut ------------------------------------------

@pytest.mark.parametrize("tied,quantization", [(False, None), (True, None), (False, "int8")])
def test_resharded_shards_load_like_a_cold_start(make_ckpt, tied, quantization):
    """Shards from a transposed trainer layout, loaded in place into a TP=2 rank built on
    checkpoint A, equal (bitwise, every kernel tensor) that rank cold-started on B."""
    a, b = make_ckpt("tiny", seed=41, tie_word_embeddings=tied), make_ckpt("tiny", seed=42, tie_word_embeddings=tied)
    config = CheckpointReader(b).config
    full = dict(CheckpointReader(b).iter_tensors())
    p = R.plan_for_model(config, R.transposed_layouts(config, 2), tp_size=2)
    shards = R.reshard_in_memory(p, [R.trainer_locals(full, p, t) for t in range(2)])
    for rank in range(2):
        hot = load_model(CheckpointReader(a), "cpu", F32, rank, 2, quantization)
        R.check_plan_matches(hot, p)
        ptrs = {k: v.data_ptr() for k, v in hot.state_dict().items()}
        assert R.load_shards(hot, shards[rank]) == set(full)
        process_weights_after_loading(hot)
        cold = load_model(CheckpointReader(b), "cpu", F32, rank, 2, quantization)
        hot_sd, cold_sd = hot.state_dict(), cold.state_dict()
        assert set(hot_sd) == set(cold_sd)
        for k in cold_sd:
            if cold_sd[k].device.type != "meta":
                assert torch.equal(hot_sd[k], cold_sd[k]), (rank, k)
                assert hot_sd[k].data_ptr() == ptrs[k], f"{k} moved"



@pytest.mark.parametrize("name,shape", [("model.layers.0.self_attn.k_proj.weight", (32, 64)),
                                        ("model.layers.0.mlp.down_proj.weight", (64, 128)),
                                        ("model.embed_tokens.weight", (512, 64))])
def test_a_shard_of_the_wrong_shape_is_refused_before_its_copy(name, shape):
    """A full tensor where this rank's part belongs (or any other wrong cut) is refused by
    the parameter's own loader, naming the tensor; the parameter keeps its bytes."""
    model = unloaded_model(preset("tiny"), rank=1, tp_size=2)
    for p in model.parameters():
        p.data.fill_(0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(R.ReshardError, match=name.replace(".", r"\.")):
        R.load_shards(model, {name: torch.ones(shape)})
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_plan_for_another_engine_layout_is_refused():
    config = preset("tiny")
    model = unloaded_model(config, rank=1, tp_size=2)
    with pytest.raises(R.ReshardError, match="tensor_parallel_size 2"):
        R.check_plan_matches(model, R.plan_for_model(config, R.transposed_layouts(config, 2), tp_size=1))
    wrong = dict(R.engine_layouts(config, 2))
    name = "model.layers.0.self_attn.q_proj.weight"
    wrong[name] = R.Layout.split(wrong[name].shape, 2, 1)  # columns, but the loaders cut rows
    shapes = {n: (s, F32) for n, s in hf_tensor_shapes(config).items()}
    with pytest.raises(R.ReshardError, match="q_proj.*its loaders hold"):
        R.check_plan_matches(model, R.plan(shapes, R.transposed_layouts(config, 2), wrong))


def unloaded_model(config, rank, tp_size):
    from course_lib.models.qwen3 import Qwen3ForCausalLM
    return Qwen3ForCausalLM(config, rank, tp_size)  # unloaded: only its structure matters here


# ---- a whole model, trainer processes -> a TP=2 engine -----------------------------------------

PROMPTS = ["resharded weights", "rows from columns"]


def test_whole_model_from_two_trainer_ranks_into_a_tp2_engine(make_ckpt):
    """Trainer ranks 0-1 (threads here, each reading only its slices of checkpoint B) and
    engine ranks 2-3 (this process and a spawned worker) in one gloo world of 4."""
    a, b = make_ckpt("tiny", seed=51), make_ckpt("tiny", seed=52)
    config = CheckpointReader(b).config
    p = R.plan_for_model(config, R.transposed_layouts(config, 2), tp_size=2)
    results = queue.Queue()

    def connect_trainers(engine):
        """Each push_resharded call is a trainer's whole life: a fresh group every time."""
        port = free_port()
        for t in range(2):
            threading.Thread(target=R.push_resharded, args=(b, p, t, port), kwargs={"results": results},
                             daemon=True).start()
        engine.init_weights_update_group("127.0.0.1", port, 2, 4, "weight_update_group", "gloo")

    with TPEngine(a, tensor_parallel_size=2) as engine:
        connect_trainers(engine)
        # Refused (a request in flight, not paused): the pieces are still received, so the
        # trainers finish, and no rank changes.
        engine.add_request(PROMPTS[0], {"max_new_tokens": 4})
        with pytest.raises(EngineBusyError):
            engine.update_weights_resharded(p, weight_version="refused")
        assert [results.get(timeout=60)[1]["bytes"] for _ in range(2)] == [p.bytes_sent(0), p.bytes_sent(1)]
        assert engine.get_weight_version() != "refused" and engine.health()["healthy"]
        cold_a = load_model(CheckpointReader(a), "cpu", F32, 1, 2).state_dict()
        assert all(torch.equal(v, cold_a[k]) for k, v in engine.rank_parameters(1).items())
        engine.pause_generation("abort")
        engine.continue_generation()
        engine.step()
        engine.destroy_weights_update_group()

        connect_trainers(engine)
        out = engine.update_weights_resharded(p, weight_version="step-1")
        stats = dict(results.get(timeout=60) for _ in range(2))
        assert out["success"] and engine.get_weight_version() == "step-1"
        # Each engine rank received exactly its shard, from both trainer ranks.
        assert out["received_bytes"] == p.bytes_received(0) and out["pieces"] == len(p.pieces_for(0)) == 50
        assert {x.src for x in p.pieces_for(0)} == {x.src for x in p.pieces_for(1)} == {0, 1}
        model_bytes = CheckpointReader(b).nbytes()
        for t in range(2):
            assert stats[t]["bytes"] == p.bytes_sent(t) and stats[t]["held_bytes"] < model_bytes * 0.6
        # Hot == cold on every rank, bitwise.
        for rank in range(2):
            cold = load_model(CheckpointReader(b), "cpu", F32, rank, 2).state_dict()
            hot = engine.rank_parameters(rank)
            assert all(torch.equal(hot[k], cold[k]) for k in cold), rank
        engine.verify_addresses_on_every_rank()
        # And the TP=2 engine computes what a TP=1 engine on B computes.
        one = Engine(b)
        ids = one.tokenizer.encode(PROMPTS[0])
        torch.testing.assert_close(prompt_logits(engine, ids), prompt_logits(one, ids), atol=2e-5, rtol=0)
        assert greedy_tokens(engine, PROMPTS) == greedy_tokens(one, PROMPTS)
        engine.destroy_weights_update_group()
