"""Registered buffers over HTTP: a real trainer process registers its CPU shared memory with
a real server once, then each update is a few integers; stale epochs, unknown buckets and
malformed registrations are 400s that change nothing; the routes need the API key; an
update whose client went away before the engine took it up is never applied."""
import base64
import http.client
import json
import multiprocessing as mp
import os
import pickle
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
import torch  # noqa: E402

from course_lib import Engine  # noqa: E402
from course_lib.layers.quant import kernel_tensors  # noqa: E402
from course_lib.server.app import DEFAULT_MAX_BODY_BYTES  # noqa: E402
from course_lib.server.client import EngineClient, EngineError  # noqa: E402
from course_lib.server.runner import BackgroundServer  # noqa: E402
from course_lib.testing import GPU_TEST_SHAPE, assert_addresses_unchanged, assert_hot_equals_cold  # noqa: E402
from course_lib.weights.transports import safe_pickle  # noqa: E402
from course_lib.weights.checkpoint import CheckpointReader, hf_tensor_shapes, preset  # noqa: E402
from course_lib.weights.transports.registered import stream_layout  # noqa: E402
from course_lib.weights.transports import trainer  # noqa: E402
from course_lib.weights.transports.registered import RegisteredSender  # noqa: E402

PROMPTS = ["registered over HTTP", "a few integers per update"]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
CTX = mp.get_context("spawn")
BUCKET = 16 << 10  # small buckets: many of them, tensors spanning two
KEY = "registered-key"
ROUTES = ("/register_weight_buffers", "/update_weights_from_registered", "/unregister_weight_buffers")


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    return make_ckpt("tiny", seed=91), make_ckpt("tiny", seed=92)


@pytest.fixture
def server(ckpts):
    with BackgroundServer(Engine(ckpts[0]), allow_weight_update=True) as srv:
        yield srv


def tensors_of(path):
    return list(CheckpointReader(path).iter_tensors())


def state(srv) -> tuple[dict, str, int]:
    """The served weights (copies), version label and update count, read on the engine thread."""
    return srv.worker.call_sync(lambda e: ({n: t.clone() for n, t in kernel_tensors(e.model).items()},
                                           e.weight_version, e.weight_update_count), timeout=60)


def assert_unchanged(srv, before) -> None:
    weights, version, count = state(srv)
    assert (version, count) == before[1:], "a refused request changed the version or the update count"
    assert all(torch.equal(weights[n], before[0][n]) for n in weights), "a refused request changed a weight"


def error_of(excinfo, status: int, code: str) -> str:
    exc = excinfo.value
    assert (exc.status, exc.code) == (status, code), str(exc)
    return exc.message


def sync_from_trainer(url: str, new, device: str, bucket_bytes: int, resident: bool) -> tuple[dict, int]:
    """A trainer process registers ``new``'s tensors over HTTP, then sends two rounds of
    bucket numbers, each acknowledged once the server replied; the flow ends flushed and
    resumed. Returns the registration's reply and the number of update messages."""
    payloads, acks = CTX.Queue(), CTX.Queue()
    child = CTX.Process(target=trainer.push_registered, args=(new, payloads, acks, bucket_bytes, device, 2, 2,
                                                              resident))
    child.start()
    try:
        with EngineClient(url, timeout=120) as client:
            kind, registration = payloads.get(timeout=120)
            assert kind == "register" and isinstance(registration, str)
            reg = client.register_weight_buffers(registration)
            assert reg["success"] and reg["tensors"] == len(CheckpointReader(new).metadata()) and reg["bytes"] > 0
            acks.put(reg["epoch"])
            client.pause_generation("retract")
            client.flush_until_done(interval_s=0.01)
            messages = 0
            for round_ in range(2):  # the same buffers, step after step
                while (item := payloads.get(timeout=120)) is not None:
                    receipt, message = item
                    assert set(message) == {"epoch", "buckets"}  # integers only: no tensor, no handle
                    result = client.update_weights_from_registered(**message, weight_version=f"step-{round_}",
                                                                   flush_cache=False)
                    assert result["success"] and result["bytes"] > 0
                    acks.put(receipt)  # the reply means the copies are done: the buffer may be reused
                    messages += 1
            client.flush_until_done(interval_s=0.01)
            client.continue_generation()
            assert client.get_weight_version() == {"weight_version": "step-1", "weight_update_count": messages}
            assert client.unregister_weight_buffers()["success"]
        assert trainer.wait_for_exit(child, 120) == 0
    finally:
        if child.is_alive():
            child.kill()
    return reg, messages


@pytest.mark.parametrize("resident", [False, True], ids=["two-buffers", "resident"])
def test_a_trainer_process_registers_over_http_then_sends_bucket_numbers(server, ckpts, resident):
    """Two buffers: one message per bucket. Resident: one message naming every bucket."""
    new = ckpts[1]
    reg, messages = sync_from_trainer(server.url, new, "cpu", BUCKET, resident)
    assert reg["buckets"] > 3 and reg["copy_mode"] == "loop"
    assert messages == (2 if resident else 2 * reg["buckets"])
    served = httpx.post(f"{server.url}/generate", json={"text": PROMPTS, "sampling_params": GREEDY}, timeout=60)
    assert [o["output_ids"] for o in served.json()] == [o["output_ids"] for o in Engine(new).generate(PROMPTS, GREEDY)]
    server.worker.call_sync(lambda e: assert_hot_equals_cold(e, new, PROMPTS), timeout=60)
    server.worker.call_sync(assert_addresses_unchanged, timeout=60)


GPU_SHAPE = GPU_TEST_SHAPE


@pytest.mark.cuda
@pytest.mark.parametrize("resident", [False, True], ids=["two-buffers", "resident"])
def test_cuda_ipc_buffers_registered_over_http_under_cuda_graphs(make_ckpt, resident):
    a, b = make_ckpt("small", seed=93, **GPU_SHAPE), make_ckpt("small", seed=94, **GPU_SHAPE)
    with BackgroundServer(Engine(a, device="cuda", enable_cuda_graph=True), allow_weight_update=True) as srv:
        reg, _ = sync_from_trainer(srv.url, b, "cuda", 1 << 20, resident)
        assert reg["copy_mode"] in ("scatter", "graph") and reg["buckets"] > 1
        srv.worker.call_sync(assert_addresses_unchanged, timeout=120)
        srv.worker.call_sync(lambda e: assert_hot_equals_cold(e, b, PROMPTS, max_new_tokens=12), timeout=300)


def test_stale_epochs_and_unknown_buckets_are_400s_that_change_nothing(server, ckpts):
    sent = tensors_of(ckpts[1])
    sender = RegisteredSender(sent, BUCKET)
    with EngineClient(server.url) as client:
        first = client.register_weight_buffers(sender.registration())["epoch"]
        second = client.register_weight_buffers(sender.registration())["epoch"]
        assert second == first + 1
        sender.epoch = second
        receipt, good = next(iter(sender.payloads(sent)))  # bucket 0 packed into its buffer
        before = state(server)
        with pytest.raises(EngineError) as stale:
            client.update_weights_from_registered([0], first, weight_version="never")
        assert f"epoch {first} is not the current one ({second})" in error_of(stale, 400, "bad_request")
        with pytest.raises(EngineError) as unknown:
            client.update_weights_from_registered([10 ** 6], second, weight_version="never")
        assert "bucket 1000000 does not exist" in error_of(unknown, 400, "bad_request")
        with pytest.raises(EngineError) as as_text:  # not a number: refused before the engine sees it
            client.request("POST", "/update_weights_from_registered", json={"buckets": ["0"], "epoch": second})
        error_of(as_text, 422, "invalid_request")
        assert_unchanged(server, before)
        assert client.update_weights_from_registered(**good, weight_version="v1")["success"]
        assert client.get_weight_version()["weight_version"] == "v1"
        assert client.unregister_weight_buffers()["message"] == f"dropped epoch {second}"
        with pytest.raises(EngineError) as gone:
            client.update_weights_from_registered([0], second)
        assert "no registered buffers" in error_of(gone, 400, "bad_request")


class Forbidden:
    """Pickles as a call of ``os.system``: what the allowlist exists to refuse."""

    def __reduce__(self):
        return os.system, ("echo this must never run",)


def test_malformed_registrations_are_400s_through_the_allowlist_and_change_nothing(server, ckpts):
    sent = tensors_of(ckpts[1])
    sender = RegisteredSender(sent, BUCKET)
    good = sender.registration(serialized=False)
    with EngineClient(server.url) as client:
        epoch = client.register_weight_buffers(sender.registration())["epoch"]
        sender.epoch = epoch
        receipt, message = next(iter(sender.payloads(sent)))
        before = state(server)
        cases = {
            "not base64": ("this is not a pickle", "unsafe_payload"),
            "not a valid pickle": (base64.b64encode(b"no pickle either").decode(), "unsafe_payload"),
            "system": (base64.b64encode(pickle.dumps({"buckets": good["buckets"], "tensors": good["tensors"],
                                                      "buffers": [Forbidden()]})).decode(), "unsafe_payload"),
            "registration refused": (safe_pickle.serialize(dict(good, tensors=good["tensors"][1:])), "bad_request"),
        }
        for expected, (payload, code) in cases.items():
            with pytest.raises(EngineError) as refused:
                client.register_weight_buffers(payload)
            assert expected in error_of(refused, 400, code), expected
        with pytest.raises(EngineError) as mode:
            client.register_weight_buffers(sender.registration(), copy_mode="warp")
        assert "choose one of" in error_of(mode, 400, "bad_request")
        assert_unchanged(server, before)
        # The registration made before them is still the current one.
        assert client.update_weights_from_registered(**message)["success"]
        # The same layout less one tensor is a valid partial registration, and the options arrive.
        partial = client.register_weight_buffers(safe_pickle.serialize(dict(good, tensors=good["tensors"][1:])),
                                                 partial=True, copy_mode="foreach")
        assert (partial["epoch"], partial["tensors"], partial["copy_mode"]) == (epoch + 1, len(sent) - 1, "foreach")


def test_the_registered_routes_need_the_api_key(ckpts):
    sent = tensors_of(ckpts[1])
    sender = RegisteredSender(sent, BUCKET)
    with BackgroundServer(Engine(ckpts[0]), allow_weight_update=True, api_key=KEY) as srv:
        for route in ROUTES:
            body = {"serialized_payload": sender.registration()} if route == ROUTES[0] else {"buckets": [0],
                                                                                             "epoch": 1}
            missing = httpx.post(f"{srv.url}{route}", json=body)
            assert missing.status_code == 401 and missing.json()["error"]["code"] == "unauthorized", route
            wrong = httpx.post(f"{srv.url}{route}", json=body, headers={"Authorization": "Bearer wrong"})
            assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "forbidden", route
        assert srv.worker.call_sync(lambda e: e.updater.transfers.registration.table, timeout=60) is None  # nothing was registered
        with EngineClient(srv.url, api_key=KEY) as client:
            sender.epoch = client.register_weight_buffers(sender.registration())["epoch"]
            for receipt, message in sender.payloads(sent):
                assert client.update_weights_from_registered(**message)["success"]
                sender.release(receipt)
            assert client.unregister_weight_buffers()["success"]


@pytest.mark.parametrize("route", ["/update_weights_from_registered", "/register_weight_buffers"])
def test_a_request_whose_client_went_away_before_the_engine_took_it_up_is_not_applied(server, ckpts, route):
    """An abandoned update writes nothing; an abandoned registration does not replace the
    live one (its new epoch would refuse the trainer still sending for the old)."""
    sent = tensors_of(ckpts[1])
    sender = RegisteredSender(sent, BUCKET)
    with EngineClient(server.url) as client:
        sender.epoch = client.register_weight_buffers(sender.registration())["epoch"]
    receipt, message = next(iter(sender.payloads(sent)))
    body = dict(message, weight_version="never") if "update" in route else {"serialized_payload":
                                                                             sender.registration()}
    before = state(server)
    gate = threading.Event()
    server.worker.submit(lambda e: gate.wait(60))  # the engine thread is busy: what arrives waits in line
    queued, submit = [], server.worker.submit
    server.worker.submit = lambda fn: queued.append(submit(fn)) or queued[-1]
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port))
    try:
        conn.request("POST", route, json.dumps(body), {"Content-Type": "application/json"})
        deadline = time.monotonic() + 30
        while not queued:
            assert time.monotonic() < deadline, f"{route} never reached the engine's queue"
            time.sleep(0.02)
        conn.close()  # the trainer is gone; its request waits behind the gate
        while not queued[0].cancelled():
            assert time.monotonic() < deadline, f"the abandoned {route} was not cancelled"
            time.sleep(0.02)
    finally:
        gate.set()
        server.worker.submit = submit
    assert_unchanged(server, before)
    with EngineClient(server.url) as client:  # the live registration's update lands
        assert client.update_weights_from_registered(**message, weight_version="v2")["success"]
    assert state(server)[1:] == ("v2", before[2] + 1)


def test_an_8b_layout_fits_the_default_body_limit(server):
    """About 400 tensor entries (the shapes of Qwen3-8B), even cut into 64 MiB buckets, make
    a body far under the limit: the server reads it and refuses the layout (400), never 413."""
    metas = [(n, torch.bfloat16, s) for n, s in hf_tensor_shapes(preset("qwen3-8b")).items()]
    layout = stream_layout(metas, 64 << 20, num_buffers=2)
    assert len(layout["tensors"]) > 390 and len(layout["buckets"]) > 200
    payload = {"buffers": [torch.empty(16, dtype=torch.uint8) for _ in layout["buffer_bytes"]],
               "buckets": layout["buckets"], "tensors": layout["tensors"]}
    body = json.dumps({"serialized_payload": safe_pickle.serialize(payload)})
    assert len(body) < DEFAULT_MAX_BODY_BYTES // 100, len(body)
    reply = httpx.post(f"{server.url}/register_weight_buffers", content=body,
                       headers={"Content-Type": "application/json"}, timeout=60)
    assert reply.status_code == 400 and "registration refused" in reply.json()["error"]["message"], reply.text
