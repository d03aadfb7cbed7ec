"""Flattened buckets over HTTP take the bucket fast path (weights/commit/bucket_cache.py): a trainer
that posts the same model's weights step after step from the same two buffers (CPU shared
memory, in this process, as test_server_protocol's bucket test sends them) has each layout
validated once and, from the second step on, every bucket copied through its cached table;
hot == cold after each step. A bad bucket is refused with 400 and the message the route
gave before it handed buckets over whole, with nothing changed and the cache still good."""
import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
import torch  # noqa: E402

from course_lib import Engine  # noqa: E402
from course_lib.layers.quant import kernel_tensors  # noqa: E402
from course_lib.server.client import EngineClient, EngineError  # noqa: E402
from course_lib.server.runner import BackgroundServer  # noqa: E402
from course_lib.testing import assert_addresses_unchanged, assert_hot_equals_cold  # noqa: E402
from course_lib.update.payload import unpack  # noqa: E402
from course_lib.weights.transports import bucket, safe_pickle  # noqa: E402
from course_lib.weights.transports.bucket import FlattenedTensorMetadata  # noqa: E402
from course_lib.weights.checkpoint import CheckpointReader  # noqa: E402
from course_lib.weights.transports.ipc import BucketSender  # noqa: E402

PROMPTS = ["buckets over HTTP", "one lookup, one copy"]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
BUCKET = 160_000  # tiny model: four buckets, none larger than a buffer (the embedding is 131072 bytes)


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    return make_ckpt("tiny", seed=61), make_ckpt("tiny", seed=62)


@pytest.fixture
def server(ckpts):
    with BackgroundServer(Engine(ckpts[0]), allow_weight_update=True) as srv:
        yield srv


def tensors_of(path):
    return list(CheckpointReader(path).iter_tensors())


def cache_of(engine):
    return engine.updater.transfers.buckets


def stats(srv) -> dict:
    return srv.worker.call_sync(lambda e: dict(cache_of(e).stats), timeout=60)


def state(srv) -> tuple[dict, str, int]:
    """The served weights (copies), version label and update count, read on the engine thread."""
    return srv.worker.call_sync(lambda e: ({n: t.clone() for n, t in kernel_tensors(e.model).items()},
                                           e.weight_version, e.weight_update_count), timeout=60)


def assert_served_hot_equals_cold(srv, path) -> None:
    outs = httpx.post(f"{srv.url}/generate", json={"text": PROMPTS, "sampling_params": GREEDY}, timeout=60).json()
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in Engine(path).generate(PROMPTS, GREEDY)]
    srv.worker.call_sync(lambda e: assert_hot_equals_cold(e, path, PROMPTS), timeout=60)
    srv.worker.call_sync(assert_addresses_unchanged, timeout=60)


def step(client: EngineClient, sender: BucketSender, path, version: str) -> int:
    """One trainer step as slime makes it: pause, one request per flattened bucket from the
    sender's reused buffers (each released once answered), the version on an empty last
    bucket, flush, resume. Returns the number of buckets."""
    client.pause_generation()
    n = 0
    for receipt, payload in sender.payloads(tensors_of(path)):
        try:
            reply = client.update_weights_from_tensor([payload], load_format="flattened_bucket", flush_cache=False)
        finally:
            sender.release(receipt)
        assert reply["success"] and reply["bytes"] > 0, reply
        n += 1
    client.update_weights_from_tensor([safe_pickle.serialize(bucket.pack([]))], load_format="flattened_bucket",
                                      flush_cache=False, weight_version=version)
    client.flush_cache()
    client.continue_generation()
    return n


def test_buckets_from_reused_buffers_hit_the_cache_over_http(server, ckpts):
    a, b = ckpts
    groups = list(bucket.group_into_buckets(tensors_of(b), BUCKET))
    # Each of the two buffers carries two buckets or more (so both stay mapped at resume), and
    # an even number of buckets puts each bucket in the same buffer every step.
    assert len(groups) >= 4 and len(groups) % 2 == 0, len(groups)
    assert all(bucket.bucket_nbytes(g) <= BUCKET for g in groups), "no bucket travels in a buffer of its own"
    sender = BucketSender(BUCKET, num_buffers=2)
    per_step = []
    with EngineClient(server.url) as client:
        for i, path in enumerate([b, a, b]):
            assert step(client, sender, path, f"step-{i}") == len(groups)
            per_step.append(stats(server))
            assert client.get_weight_version()["weight_version"] == f"step-{i}"
            assert_served_hot_equals_cold(server, path)
    n = len(groups)
    first, second, third = per_step
    # The first step validates each layout and builds each buffer's table, once.
    assert (first["layouts_validated"], first["tables_built"], first["layout_hits"], first["table_hits"]) == \
        (n, n, 0, 0)
    # From then on every bucket is one lookup and one copy through the table of its buffer.
    for k, later in enumerate((second, third), start=1):
        assert (later["layouts_validated"], later["tables_built"]) == (n, n), later
        assert (later["layout_hits"], later["table_hits"]) == (k * n, k * n), later
        assert later["buffers_dropped"] == 0, later


def test_pairs_over_http_still_take_the_general_path(server, ckpts):
    """Pairs (not a bucket) are decoded in the thread pool and written as before."""
    b = ckpts[1]
    with EngineClient(server.url) as client:
        client.pause_generation()
        client.update_weights_from_tensor([safe_pickle.serialize(tensors_of(b))], weight_version="pairs")
        client.continue_generation()
    assert stats(server)["layouts_validated"] == 0
    assert_served_hot_equals_cold(server, b)


def corrupted(packed, k, **change):
    meta = list(packed["metadata"])
    m = meta[k]
    fields = dict(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel)
    fields.update(change)
    meta[k] = FlattenedTensorMetadata(**fields)
    return {"flattened_tensor": packed["flattened_tensor"], "metadata": meta}


def message_before(reference: Engine, payload: str) -> str:
    """What the route answered before it handed buckets over whole: the payload unpacked into
    pairs in the thread pool (a bad bucket refused there), then the pairs checked by the engine."""
    try:
        pairs = unpack(safe_pickle.deserialize(payload))
        reference.pause_generation()
        reference.update_weights_from_tensor(pairs)
    except ValueError as exc:
        return str(exc)
    raise AssertionError("the reference engine accepted a bad bucket")


def test_a_bad_bucket_over_http_is_400_and_changes_nothing(server, ckpts):
    a, b = ckpts
    sender = BucketSender(BUCKET, num_buffers=2)
    with EngineClient(server.url) as client:
        n = step(client, sender, b, "good")  # every layout cached, in the sender's two buffers
        # The next step's third bucket, packed where every step's third bucket travels (the
        # sender's buffer 0, as the step's bucket count is even): its layout and its table
        # over that buffer are cached.
        assert n % 2 == 0, n
        third = list(bucket.group_into_buckets(tensors_of(a), BUCKET))[2]
        good = bucket.pack(third, out=sender._buffers[0])
        k = next(i for i, m in enumerate(good["metadata"]) if len(m.shape) == 2 and i > 0)
        m, end = good["metadata"][k], good["flattened_tensor"].numel()
        bad = {
            "unknown name": corrupted(good, k, name="model.layers.0.mlp.nope.weight"),
            "offsets past the end": corrupted(good, k, start_idx=end, end_idx=end + m.end_idx - m.start_idx),
            "numel disagrees with the shape": corrupted(good, k, numel=m.numel + 1),
            "named twice": corrupted(good, k, name=good["metadata"][k - 1].name),
            "no bucket at all": [(m.name, torch.zeros(tuple(m.shape)))],
        }
        client.pause_generation()
        before, cached = state(server), stats(server)
        reference = Engine(a)
        for why, obj in bad.items():
            text = safe_pickle.serialize(obj)
            with pytest.raises(EngineError) as excinfo:
                client.update_weights_from_tensor([text], load_format="flattened_bucket", flush_cache=False,
                                                  weight_version="evil")
            err = excinfo.value
            assert (err.status, err.code) == (400, "bad_request"), f"{why}: {err}"
            assert err.message == message_before(reference, text), why
            weights, version, count = state(server)
            assert (version, count) == before[1:], f"{why}: the version or the update count changed"
            assert all(torch.equal(weights[n_], before[0][n_]) for n_ in weights), f"{why}: a weight changed"
            now = stats(server)
            assert now["layouts_validated"] == cached["layouts_validated"], f"{why}: a refused layout was kept"
        # The cache is still good: the next step (no resume in between, so every buffer
        # stays mapped) is all hits, and serves exactly the new weights.
        assert step(client, sender, a, "after") == n
    last = stats(server)
    assert last["table_hits"] - cached["table_hits"] == n and last["tables_built"] == cached["tables_built"]
    assert_served_hot_equals_cold(server, a)
