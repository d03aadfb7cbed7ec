"""Registered buffers (weights/commit/copy_table.py): a real trainer process registers its shared
memory once, then sends bucket numbers; the fast path writes exactly what the bucket path
writes; bad layouts, stale epochs and rebound weights are refused with nothing changed."""
import multiprocessing as mp
import queue

import pytest
import torch

from course_lib import Engine
from course_lib.layers.quant import kernel_tensors
from course_lib.testing import GPU_TEST_SHAPE, assert_addresses_unchanged, assert_hot_equals_cold
from course_lib.exercises import is_reference
from course_lib.weights.commit import copy_table, scatter_copy
from course_lib.weights.transports import safe_pickle
from course_lib.weights.checkpoint import CheckpointReader
from course_lib.weights.commit.copy_plan import COMMIT_STEP, CopyPlan
from course_lib.weights.transports.registered import stream_layout
from course_lib.weights.transports import trainer
from course_lib.weights.transports.registered import RegisteredSender
from course_lib.weights.commit.validate import UpdateError

PROMPTS = ["registered once", "then only numbers"]
CTX = mp.get_context("spawn")
BUCKET = 16 << 10  # small buckets: many tensors span two of them


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    return make_ckpt("tiny", seed=71), make_ckpt("tiny", seed=72)


def tensors_of(path, dtype=None):
    return [(n, t if dtype is None else t.to(dtype)) for n, t in CheckpointReader(path).iter_tensors()]


def weights(engine):
    return {n: t.clone() for n, t in kernel_tensors(engine.model).items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def push_all(engine, sender, tensors, **kwargs):
    result = None
    for receipt, message in sender.payloads(tensors):
        result = engine.update_weights_from_registered(**message, **kwargs)
        sender.release(receipt)
    return result


@pytest.mark.parametrize("resident", [False, True], ids=["two-buffers-over-queues", "resident-over-pipes"])
def test_a_trainer_process_registers_once_then_sends_bucket_numbers(ckpts, resident):
    a, b = ckpts
    engine = Engine(a)
    # Both channels a trainer may use: queues, and pipes (trainer.Channel, the benchmarks').
    payloads, acks = (trainer.Channel(CTX), trainer.Channel(CTX)) if resident else (CTX.Queue(), CTX.Queue())
    child = CTX.Process(target=trainer.push_registered, args=(b, payloads, acks, BUCKET, "cpu", 2, 2, resident))
    child.start()
    kind, registration = payloads.get(timeout=60)
    assert kind == "register"
    reg = engine.register_weight_buffers(registration)
    assert reg["buckets"] > 3 and reg["tensors"] == len(CheckpointReader(b).metadata())
    acks.put(reg["epoch"])
    engine.pause_generation("retract")
    messages = 0
    for round_ in range(2):  # the same buffers, step after step
        while (item := payloads.get(timeout=60)) is not None:
            receipt, message = item
            assert set(message) == {"epoch", "buckets"}  # a few integers: no tensor, no handle
            result = engine.update_weights_from_registered(**message, weight_version=f"step-{round_}")
            assert result["success"] and result["bytes"] > 0
            acks.put(receipt)
            messages += 1
    assert trainer.wait_for_exit(child) == 0
    assert messages == (2 if resident else 2 * reg["buckets"])
    engine.continue_generation()
    assert engine.get_weight_version() == "step-1"
    assert_addresses_unchanged(engine)
    assert_hot_equals_cold(engine, b, PROMPTS)


@pytest.mark.parametrize("mode", ["loop", "foreach"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["same-dtype", "bf16-into-fp32"])
def test_the_fast_path_writes_exactly_what_the_bucket_path_writes(ckpts, mode, dtype):
    a, b = ckpts
    sent = tensors_of(b, dtype)
    reference = Engine(a)
    reference.update_weights_from_tensor(sent)
    fast = Engine(a)
    sender = RegisteredSender(sent, BUCKET, num_buffers=2)
    sender.epoch = fast.register_weight_buffers(sender.registration(), copy_mode=mode)["epoch"]
    push_all(fast, sender, sent)
    assert same(weights(fast), weights(reference))
    if dtype is None:
        assert_hot_equals_cold(fast, b, PROMPTS)


def test_a_layout_that_does_not_match_the_model_is_refused_whole(ckpts):
    a, b = ckpts
    engine = Engine(a)
    before = weights(engine)
    sent = tensors_of(b)
    sender = RegisteredSender(sent, BUCKET)
    good = {"buffers": sender.buffers, "buckets": sender.layout["buckets"], "tensors": sender.layout["tensors"]}

    def variant(**change):
        payload = {k: ([list(x) if isinstance(x, list) else x for x in v] if isinstance(v, list) else v)
                   for k, v in good.items()}
        payload.update(change)
        return payload
    tensors = good["tensors"]
    first = tensors[0]
    cases = {
        "match no parameter": variant(tensors=[["model.nope.weight", *first[1:]]] + tensors[1:]),
        "missing for a full update": variant(tensors=tensors[1:]),
        "shape": variant(tensors=[[first[0], first[1], [first[2][0] + 1, *first[2][1:]], first[3]]] + tensors[1:]),
        "more than once": variant(tensors=[first] + tensors),
        "not inside buffer": variant(buckets=[[0, 0, 1 << 40]] + good["buckets"][1:]),
        "names buffer": variant(buckets=[[7, 0, 16]] + good["buckets"][1:]),
        "pieces hold": variant(tensors=[[*first[:3], first[3][:-1] or [[0, 0, 16]]]] + tensors[1:]),
        "read the same bytes": variant(tensors=[tensors[0], [*tensors[1][:3], tensors[0][3]]] + tensors[2:]),
        "uint8 tensor": variant(buffers=[b.float() for b in good["buffers"]]),
        "unknown dtype": variant(tensors=[[first[0], "quaternion", *first[2:]]] + tensors[1:]),
    }
    for expected, payload in cases.items():
        with pytest.raises(UpdateError, match=expected):
            engine.register_weight_buffers(payload)
    assert same(weights(engine), before)
    with pytest.raises(UpdateError, match="no registered buffers"):
        engine.update_weights_from_registered([0], epoch=0)


def test_stale_epochs_and_bad_bucket_numbers_change_nothing(ckpts):
    a, b = ckpts
    engine = Engine(a)
    sent = tensors_of(b)
    sender = RegisteredSender(sent, BUCKET)
    first = engine.register_weight_buffers(sender.registration())["epoch"]
    second = engine.register_weight_buffers(sender.registration())["epoch"]
    assert second == first + 1
    sender.epoch = second
    packed = next(iter(sender.payloads(sent)))  # bucket 0 packed into its buffer
    before, version = weights(engine), engine.get_weight_version()
    for buckets, epoch, expected in (([0], first, "epoch 1 is not the current one"),
                                     ([10 ** 6], second, "does not exist"),
                                     ([0, 0], second, "more than once"),
                                     ([], second, "non-empty list"),
                                     (["0"], second, "non-empty list")):
        with pytest.raises(UpdateError, match=expected):
            engine.update_weights_from_registered(buckets, epoch, weight_version="never")
    assert same(weights(engine), before) and engine.get_weight_version() == version
    assert engine.update_weights_from_registered(**packed[1])["success"]
    assert engine.unregister_weight_buffers()["success"]
    with pytest.raises(UpdateError, match="no registered buffers"):
        engine.update_weights_from_registered([0], epoch=second)


@pytest.mark.parametrize("rebind", ["data", "attribute"])
def test_a_weight_rebound_after_registration_is_refused_before_anything_is_written(ckpts, rebind):
    a, b = ckpts
    engine = Engine(a)
    sent = tensors_of(b)
    sender = RegisteredSender(sent, BUCKET, resident=True)
    sent = sender.adopt(sent)
    sender.epoch = engine.register_weight_buffers(sender.registration())["epoch"]
    layer = engine.model.model.layers[0].self_attn.qkv_proj
    # The bugs a captured graph would never see: new memory behind the same Parameter,
    # or a new Parameter in the module.
    if rebind == "data":
        layer.weight.data = layer.weight.data.clone()
    else:
        layer.weight = torch.nn.Parameter(layer.weight.data.clone(), requires_grad=False)
    before = weights(engine)
    with pytest.raises(UpdateError, match="qkv_proj.weight .* no longer lives where it was registered"):
        push_all(engine, sender, sent)
    assert same(weights(engine), before)


# ---- whose code copies: the table's copies stand in for chapter 04's commit step only ------------

def test_the_commit_step_is_the_instructor_editions_here():
    assert is_reference(CopyPlan.apply, COMMIT_STEP)


def registered_run(engine, sent, mode="loop"):
    sender = RegisteredSender(sent, BUCKET, num_buffers=2)
    sender.epoch = engine.register_weight_buffers(sender.registration(), copy_mode=mode)["epoch"]
    return push_all(engine, sender, sent)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["same-dtype", "bf16-into-fp32"])
def test_a_learners_commit_step_copies_every_registered_piece(ckpts, monkeypatch, dtype):
    """A learner's commit step (here the reference wrapped, so its source differs) is what
    copies: once per message, every piece of it, and the weights are the bucket path's."""
    a, b = ckpts
    sent = tensors_of(b, dtype)
    reference = Engine(a)
    reference.update_weights_from_tensor(sent)
    original, calls = CopyPlan.apply, []

    def learners_commit_step(self, named_tensors):
        named_tensors = list(named_tensors)
        calls.append([name for name, _ in named_tensors])
        return original(self, named_tensors)
    monkeypatch.setattr(CopyPlan, "apply", learners_commit_step)
    assert not is_reference(CopyPlan.apply, COMMIT_STEP)
    engine = Engine(a)
    calls.clear()  # start-up does not copy through it; only the updates below count
    registered_run(engine, sent, mode="foreach")
    pieces = [label for call in calls for label in call]
    assert len(calls) > 3 and len(pieces) == len(set(pieces)) > len(sent), "one call per bucket, every piece once"
    assert same(weights(engine), weights(reference))


def test_a_wrong_commit_step_shows_in_the_weights(ckpts, monkeypatch):
    """A commit step that copies nothing leaves the weights as they were: the registered path
    does not do its work for it."""
    a, b = ckpts
    monkeypatch.setattr(CopyPlan, "apply", lambda self, named_tensors: None)
    engine = Engine(a)  # built after the change, as a learner's is: the engine reads its parts once
    before = weights(engine)
    registered_run(engine, tensors_of(b))
    assert same(weights(engine), before)


def test_an_unwritten_commit_step_is_switched_off(ckpts, monkeypatch):
    """The student edition before chapter 04: the stub raises before reading anything, and
    the table's own copies run (as the loaders do on the other paths)."""
    a, b = ckpts
    sent = tensors_of(b)
    reference = Engine(a)
    reference.update_weights_from_tensor(sent)

    def stub(self, named_tensors):
        raise NotImplementedError("ch04.copy_in_place: write this part")
    monkeypatch.setattr(CopyPlan, "apply", stub)
    engine = Engine(a)
    registered_run(engine, sent)
    assert same(weights(engine), weights(reference))


def test_registration_is_refused_where_bytes_cannot_be_copied_straight_in(ckpts):
    a, b = ckpts
    engine = Engine(a, quantization="int8")
    sender = RegisteredSender(tensors_of(b), BUCKET)
    with pytest.raises(UpdateError, match="unquantized engine on one rank"):
        engine.register_weight_buffers(sender.registration())


def test_the_layout_cuts_tensors_at_bucket_edges_and_covers_every_byte_once():
    metas = [("a", torch.float32, (10,)), ("b", torch.bfloat16, (3, 7)), ("c", torch.float16, (0,)),
             ("d", torch.float32, (40,))]
    layout = stream_layout(metas, 64, num_buffers=2)
    sizes = [b[2] for b in layout["buckets"]]
    # a: bytes [0, 40); b: [48, 90); c: none; d: [96, 256): four buckets of 64, two buffers in turn.
    assert sizes == [64, 64, 64, 64] and [b[0] for b in layout["buckets"]] == [0, 1, 0, 1]
    for (name, dtype, shape), (reg_name, _, _, pieces) in zip(metas, layout["tensors"]):
        assert reg_name == name
        assert sum(n for _, _, n in pieces) == torch.Size(shape).numel() * dtype.itemsize
    assert layout["tensors"][3][3][0][0] != layout["tensors"][3][3][-1][0]  # "d" spans buckets
    resident = stream_layout(metas, 64, num_buffers=None)
    assert len(resident["buffer_bytes"]) == 1 and [b[1] for b in resident["buckets"]] == [0, 64, 128, 192]
    assert safe_pickle.deserialize(safe_pickle.serialize(layout)) == layout  # plain data through the allowlist


GPU_SHAPE = GPU_TEST_SHAPE


@pytest.mark.cuda
@pytest.mark.parametrize("resident", [False, True], ids=["two-buffers", "resident"])
def test_cuda_ipc_registered_once_under_cuda_graphs(make_ckpt, resident):
    a, b = make_ckpt("small", seed=73, **GPU_SHAPE), make_ckpt("small", seed=74, **GPU_SHAPE)
    engine = Engine(a, device="cuda", enable_cuda_graph=True)
    payloads, acks = CTX.Queue(), CTX.Queue()
    child = CTX.Process(target=trainer.push_registered, args=(b, payloads, acks, 1 << 20, "cuda", 2, 2, resident))
    child.start()
    _, registration = payloads.get(timeout=120)
    reg = engine.register_weight_buffers(registration)
    assert reg["copy_mode"] in ("scatter", "graph") and reg["buckets"] > 1
    acks.put(reg["epoch"])
    engine.pause_generation("retract")
    for _ in range(2):
        while (item := payloads.get(timeout=120)) is not None:
            engine.update_weights_from_registered(**item[1], flush_cache=False)
            acks.put(item[0])
    assert trainer.wait_for_exit(child, 120) == 0
    engine.flush_cache()
    engine.continue_generation()
    assert_addresses_unchanged(engine)
    assert_hot_equals_cold(engine, b, PROMPTS, max_new_tokens=12)


@pytest.mark.cuda
def test_cuda_copy_modes_write_the_same_bytes_and_a_rebind_is_refused(make_ckpt):
    a, b = make_ckpt("small", seed=75, **GPU_SHAPE), make_ckpt("small", seed=76, **GPU_SHAPE)
    sent = [(n, t.cuda()) for n, t in CheckpointReader(b).iter_tensors()]
    reference = Engine(a, device="cuda", enable_cuda_graph=True)
    reference.update_weights_from_tensor(sent)
    for mode in ("loop", "foreach", "graph", "scatter"):
        engine = Engine(a, device="cuda", enable_cuda_graph=True)
        sender = RegisteredSender(sent, 1 << 20, device="cuda", resident=True)
        mine = sender.adopt(sent)
        sender.epoch = engine.register_weight_buffers(sender.registration(serialized=False), copy_mode=mode)["epoch"]
        push_all(engine, sender, mine)
        assert same(weights(engine), weights(reference)), mode
    layer = engine.model.model.layers[0].mlp.down_proj
    layer.weight.data = layer.weight.data.clone()
    before = weights(engine)
    with pytest.raises(UpdateError, match="down_proj.weight .* no longer lives where it was registered"):
        push_all(engine, sender, mine)
    assert same(weights(engine), before)


def test_a_channel_delivers_in_order_and_says_when_nothing_came():
    channel = trainer.Channel(CTX)
    channel.put({"epoch": 1, "buckets": [0, 1]})
    channel.put(None)
    assert channel.get(timeout=5) == {"epoch": 1, "buckets": [0, 1]} and channel.get(timeout=5) is None
    with pytest.raises(queue.Empty, match="no message within 0.05 s"):
        channel.get(timeout=0.05)


def test_scatter_table_has_a_row_per_chunk_and_refuses_unaligned_pieces():
    # A row is (source address, destination address, 8-byte words); a piece longer than
    # a chunk becomes several rows.
    buf, out = torch.zeros(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    srcs, dsts = [buf[0:1024], buf[1024:1056]], [out[2048:3072], out[0:32]]
    rows = [tuple(r) for r in scatter_copy.build_table(srcs, dsts, chunk_bytes=256).tolist()]
    expected = [(buf.data_ptr() + i, out.data_ptr() + 2048 + i, 32) for i in range(0, 1024, 256)]
    assert rows == expected + [(buf.data_ptr() + 1024, out.data_ptr(), 4)]
    assert scatter_copy.build_table([buf[8:40]], [out[0:32]]) is None      # a source off 16-byte alignment
    assert scatter_copy.build_table([buf[0:24]], [out[0:24]]) is None      # a length off 16 bytes
    with pytest.raises(ValueError, match="multiple of 16"):
        scatter_copy.build_table(srcs, dsts, chunk_bytes=100)
