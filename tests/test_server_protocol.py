"""The weight-sync protocol end to end over a real HTTP server on 127.0.0.1: slime's calls,
bucketed IPC, disk and a gloo broadcast from a trainer process, each ending hot == cold."""
import json
import multiprocessing as mp

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from course_lib import Engine  # noqa: E402
from course_lib.server.client import EngineClient  # noqa: E402
from course_lib.server.runner import BackgroundServer  # noqa: E402
from course_lib.testing import assert_addresses_unchanged, assert_hot_equals_cold  # noqa: E402
from course_lib.weights.transports import bucket, safe_pickle  # noqa: E402
from course_lib.weights.checkpoint import CheckpointReader  # noqa: E402
from course_lib.weights.transports import trainer  # noqa: E402
from course_lib.weights.transports.ipc import BucketSender  # noqa: E402
from course_lib.weights.transports.dist import free_port  # noqa: E402

PROMPTS = ["weights over HTTP", "the trainer pushes, the engine serves"]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
CTX = mp.get_context("spawn")  # forked children hang on torch's thread pools


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    return make_ckpt("tiny", seed=51), make_ckpt("tiny", seed=52)


@pytest.fixture
def server(ckpts):
    with BackgroundServer(Engine(ckpts[0]), allow_weight_update=True) as srv:
        yield srv


def served_tokens(url: str) -> list[list[int]]:
    outs = httpx.post(f"{url}/generate", json={"text": PROMPTS, "sampling_params": GREEDY}, timeout=60).json()
    return [o["output_ids"] for o in outs]


def cold_tokens(path) -> list[list[int]]:
    return [o["output_ids"] for o in Engine(path).generate(PROMPTS, GREEDY)]


def assert_served_hot_equals_cold(server, path) -> None:
    assert served_tokens(server.url) == cold_tokens(path)
    server.worker.call_sync(lambda e: assert_hot_equals_cold(e, path, PROMPTS), timeout=60)
    server.worker.call_sync(assert_addresses_unchanged, timeout=60)


def test_slime_calls_verbatim(server, ckpts):
    """The bodies slime's SGLang engine wrapper posts, with a plain HTTP client."""
    url, new = server.url, ckpts[1]
    assert httpx.post(f"{url}/pause_generation", json={}).json() == {
        "paused": True, "mode": "abort", "num_aborted_requests": 0}
    for _ in range(60):  # slime: GET, 1 s apart, 60 tries
        if httpx.get(f"{url}/flush_cache").status_code == 200:
            break
    else:
        raise AssertionError("flush_cache never answered 200")
    sender = BucketSender(bucket_bytes=60_000)
    buckets = 0
    for receipt, payload in sender.payloads(CheckpointReader(new).iter_tensors()):
        reply = httpx.post(f"{url}/update_weights_from_tensor", json={
            "serialized_named_tensors": [payload], "load_format": "flattened_bucket", "flush_cache": False})
        assert reply.status_code == 200 and reply.json()["success"], reply.text
        sender.release(receipt)
        buckets += 1
    reply = httpx.post(f"{url}/update_weights_from_tensor", json={
        "serialized_named_tensors": [safe_pickle.serialize(bucket.pack([]))], "load_format": "flattened_bucket",
        "flush_cache": False, "weight_version": "step-1"})
    assert reply.json()["success"] and buckets > 3
    assert httpx.post(f"{url}/continue_generation", json={}).json() == {"paused": False}
    assert httpx.get(f"{url}/get_weight_version").json() == {"weight_version": "step-1",
                                                              "weight_update_count": buckets}
    assert_served_hot_equals_cold(server, new)


def test_client_sync_weights_makes_slimes_calls_in_order(server, ckpts):
    sent = []
    with EngineClient(server.url) as client:
        client.http.event_hooks["request"] = [
            lambda r: sent.append((r.method, r.url.path, json.loads(r.content) if r.content else None))]
        times = client.sync_weights(named_tensors=CheckpointReader(ckpts[1]).iter_tensors(), weight_version="v2",
                                    bucket_bytes=60_000, flush_interval_s=0.01)
        assert client.get_weight_version()["weight_version"] == "v2"
    calls = [(m, p) for m, p, _ in sent]
    n = times["buckets"]
    assert n > 3 and calls == ([("POST", "/pause_generation"), ("GET", "/flush_cache")]
                               + [("POST", "/update_weights_from_tensor")] * (n + 1)
                               + [("GET", "/flush_cache"), ("POST", "/continue_generation"),
                                  ("GET", "/get_weight_version")])
    assert sent[0][2] == {}  # slime posts an empty body: the server's default mode, abort
    updates = [body for _, p, body in sent if p == "/update_weights_from_tensor"]
    assert all(b["load_format"] == "flattened_bucket" and b["flush_cache"] is False for b in updates)
    assert [b["weight_version"] for b in updates] == [None] * n + ["v2"]  # the empty last bucket sets it
    assert set(times) >= {"pause_s", "flush_wait_s", "update_s", "flush_s", "continue_s", "total_s"}
    assert_served_hot_equals_cold(server, ckpts[1])


def test_sync_weights_from_disk_in_retract_mode(server, ckpts):
    with EngineClient(server.url) as client:
        times = client.sync_weights(model_path=ckpts[1], weight_version="disk-1", pause_mode="retract",
                                    flush_interval_s=0.01)
        assert times["bytes"] > 0 and client.get_weight_version()["weight_version"] == "disk-1"
    assert_served_hot_equals_cold(server, ckpts[1])


def test_generate_shapes_single_batch_and_input_ids(server):
    url = server.url
    one = httpx.post(f"{url}/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY}).json()
    assert set(one) == {"text", "output_ids", "meta_info"} and len(one["output_ids"]) == 8
    meta = one["meta_info"]
    assert meta["weight_version"] == "default"
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 8}]
    ids = server.engine.tokenizer.encode(PROMPTS[0])  # the tokenizer is stateless: safe to use from here
    by_ids = httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": GREEDY}).json()
    assert by_ids["output_ids"] == one["output_ids"]
    batch_ids = httpx.post(f"{url}/generate", json={"input_ids": [ids], "sampling_params": [GREEDY]}).json()
    assert [o["output_ids"] for o in batch_ids] == [one["output_ids"]]
    params = [dict(GREEDY, max_new_tokens=3), dict(GREEDY, max_new_tokens=5)]
    batch = httpx.post(f"{url}/generate", json={"text": PROMPTS, "sampling_params": params}).json()
    assert [o["meta_info"]["completion_tokens"] for o in batch] == [3, 5]


def test_version_label_and_get_weights_by_name_read_the_served_weights(server, ckpts):
    url = server.url
    assert httpx.post(f"{url}/update_weight_version", json={"new_version": "label-7"}).json() == {
        "success": True, "new_version": "label-7"}
    assert httpx.get(f"{url}/get_weight_version").json()["weight_version"] == "label-7"
    name = "model.layers.0.mlp.gate_proj.weight"
    old = httpx.get(f"{url}/get_weights_by_name", params={"name": name, "truncate_size": 2}).json()
    with EngineClient(url) as client:
        client.update_weights_from_disk(ckpts[1])
        new = client.get_weights_by_name(name, truncate_size=2)
    want = dict(CheckpointReader(ckpts[1]).iter_tensors())[name][:2].tolist()
    assert new == want != old
    assert httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 2}).json() == want


def test_update_from_distributed_with_a_gloo_trainer(server, ckpts):
    new, port, announcements, results = ckpts[1], free_port(), CTX.Queue(), CTX.Queue()
    child = CTX.Process(target=trainer.push_broadcast, args=(new, port, announcements, 60_000),
                        kwargs={"results": results})
    child.start()
    try:
        with EngineClient(server.url, timeout=120) as client:
            # Blocks until the trainer (rank 0) has joined; the engine is rank 1 of 2.
            assert client.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo")["success"]
            client.pause_generation()
            client.flush_until_done(interval_s=0.01)
            buckets = 0
            while (request := announcements.get(timeout=60)) is not None:
                # Returns once this bucket's broadcast has arrived and been loaded.
                assert client.update_weights_from_distributed(**request, flush_cache=False)["success"]
                buckets += 1
            client.update_weight_version("dist-1")
            client.flush_cache()
            client.continue_generation()
            assert client.destroy_weights_update_group()["success"]
            assert client.health()["healthy"]
        stats = results.get(timeout=60)
        assert trainer.wait_for_exit(child, 60) == 0 and buckets == stats["buckets"] > 2
    finally:
        if child.is_alive():
            child.kill()
    assert_served_hot_equals_cold(server, new)
