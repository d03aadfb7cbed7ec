"""Hostile requests at the HTTP edge, over a real server: every one is a 400 naming what was
wrong (never a 500), changes nothing, and the server keeps serving afterwards. A failure
inside a step (NaN weights) ends the requests that hit it, not the server."""
import json
import os
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
import torch  # noqa: E402

from course_lib import Engine  # noqa: E402
from course_lib.engine.sequence import SamplingParams  # noqa: E402
from course_lib.server.runner import BackgroundServer  # noqa: E402
from course_lib.weights.transports import safe_pickle  # noqa: E402
from course_lib.weights.transports.dist import free_port  # noqa: E402

GREEDY = {"max_new_tokens": 3, "temperature": 0}

BAD_SAMPLING = [
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", -0.5), ("temperature", "abc"),
    ("temperature", True), ("top_p", float("nan")), ("top_p", 0), ("top_p", 1.5), ("top_p", "1"),
    ("max_new_tokens", 0), ("max_new_tokens", -3), ("max_new_tokens", 2.5), ("max_new_tokens", True),
    ("max_new_tokens", "8"), ("max_new_tokens", float("inf")), ("seed", 1.5), ("seed", "abc"), ("seed", -1),
    ("seed", True), ("seed", 2 ** 70), ("ignore_eos", "yes"), ("ignore_eos", 1),
]


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return make_ckpt("tiny", seed=81)


@pytest.fixture
def server(ckpt):
    with BackgroundServer(Engine(ckpt), allow_weight_update=True) as srv:
        yield srv


def post(srv, route, body, timeout=30.0):
    # json.dumps, not httpx's json=: NaN and Infinity must go out as Python writes them.
    return httpx.post(f"{srv.url}{route}", content=json.dumps(body), timeout=timeout,
                      headers={"Content-Type": "application/json"})


def assert_400(reply, *words):
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]["message"]
    for word in words:
        assert word in message, message
    return message


def idle(srv) -> bool:
    """Nothing queued, running or waiting to be handed back in the engine."""
    return srv.worker.call_sync(lambda e: not e.has_unfinished_requests() and not e.requests, timeout=30)


@pytest.mark.parametrize("field,value", BAD_SAMPLING, ids=[f"{f}={v!r}" for f, v in BAD_SAMPLING])
def test_engine_api_refuses_bad_sampling_params(field, value):
    with pytest.raises((ValueError, TypeError), match=field):
        SamplingParams.coerce({field: value})


def test_bad_sampling_params_are_400_naming_the_field_and_the_server_keeps_serving(server):
    for field, value in BAD_SAMPLING:
        reply = post(server, "/generate", {"text": "hi", "sampling_params": {field: value}})
        assert_400(reply, f"sampling_params.{field}")
    assert post(server, "/generate", {"text": "hi", "sampling_params": GREEDY}).status_code == 200
    assert idle(server)


def test_batch_with_one_bad_prompt_is_refused_whole(server):
    before = server.worker.call_sync(lambda e: e.num_requests)
    assert_400(post(server, "/generate", {"text": ["ok", ""], "sampling_params": GREEDY}), "text[1]")
    assert_400(post(server, "/generate", {"input_ids": [[1, 2], [3, 10 ** 9]], "sampling_params": GREEDY}),
               "input_ids[1]")
    bad_params = [GREEDY, {"seed": 1.5}]
    assert_400(post(server, "/generate", {"text": ["a", "b"], "sampling_params": bad_params}), "sampling_params[1]")
    assert idle(server)
    assert server.worker.call_sync(lambda e: e.num_requests) == before  # nothing was ever queued


def test_a_huge_prompt_is_refused_before_it_is_tokenized(server):
    calls = []
    encode = server.engine.tokenizer.encode
    server.engine.tokenizer.encode = lambda text: calls.append(len(text)) or encode(text)
    limit = server.engine.config.max_model_len
    reply = post(server, "/generate", {"text": "x" * (5 << 20), "sampling_params": GREEDY})
    assert_400(reply, "text", str(limit))
    assert calls == []
    assert post(server, "/generate", {"text": "hi", "sampling_params": GREEDY}).status_code == 200


def test_a_disconnected_clients_requests_are_aborted(server):
    body = b'{"text": "a long one", "sampling_params": {"max_new_tokens": 900, "ignore_eos": true}}'
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 30
    while not server.worker.call_sync(lambda e: len(e.requests)):
        assert time.monotonic() < deadline, "the request never arrived"
        time.sleep(0.01)
    # Frozen, so it cannot simply finish by itself while we watch.
    assert post(server, "/pause_generation", {"mode": "in_place"}).status_code == 200
    sock.close()
    deadline = time.monotonic() + 5
    while server.worker.call_sync(lambda e: len(e.requests)):
        assert time.monotonic() < deadline, "the abandoned request was never aborted"
        time.sleep(0.02)
    assert post(server, "/continue_generation", {}).status_code == 200
    assert idle(server)


def nan_everywhere(srv, name: str) -> None:
    shape = srv.worker.call_sync(lambda e: tuple(e.get_weights_by_name(name, 10 ** 9).shape))
    payload = safe_pickle.serialize([(name, torch.full(shape, float("nan")))])
    assert post(srv, "/update_weights_from_tensor", {"serialized_named_tensors": [payload]}).status_code == 200


def test_nan_weights_end_the_requests_that_hit_them_not_the_server(server):
    nan_everywhere(server, "model.norm.weight")
    sampled = post(server, "/generate", {"text": ["one", "two"], "sampling_params": {"max_new_tokens": 4}})
    assert sampled.status_code == 200, sampled.text
    for out in sampled.json():
        assert out["meta_info"]["finish_reason"]["type"] == "error", out
    assert idle(server)  # nothing left spinning
    greedy = post(server, "/generate", {"text": "hi", "sampling_params": GREEDY, "return_logprob": True})
    assert greedy.status_code == 200, greedy.text  # NaN logprobs still make valid JSON
    health = httpx.get(f"{server.url}/health").json()
    assert health["healthy"] is True and health["step_errors"] == 1 and "nan" in health["last_step_error"].lower()
    values = httpx.get(f"{server.url}/get_weights_by_name", params={"name": "model.norm.weight"})
    assert values.status_code == 200 and set(values.json()) == {"NaN"}


def test_model_path_that_is_not_a_directory_of_regular_files_is_400(server, ckpt, tmp_path):
    bad = tmp_path / "fifo-ckpt"
    bad.mkdir()
    with open(os.path.join(ckpt, "config.json"), "rb") as f:
        (bad / "config.json").write_bytes(f.read())
    fifo = bad / "model.safetensors"
    os.mkfifo(fifo)
    try:
        reply = post(server, "/update_weights_from_disk", {"model_path": str(bad)}, timeout=10)
        assert_400(reply, "model.safetensors", "regular file")
    finally:  # a server that opened the FIFO is blocked on it: let it go
        fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
        os.close(fd)
    long_name = "/tmp/" + "a" * 300 + "/x"
    assert_400(post(server, "/update_weights_from_disk", {"model_path": long_name}), "model_path")
    assert post(server, "/generate", {"text": "hi", "sampling_params": GREEDY}).status_code == 200


def test_group_to_a_closed_port_fails_fast_and_never_stalls_generation(server, monkeypatch):
    monkeypatch.setenv("COURSE_LIB_GROUP_CONNECT_TIMEOUT_S", "3")
    port = free_port()  # nobody listens there
    result = {}

    def join():
        t0 = time.monotonic()
        result["reply"] = post(server, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2})
        result["s"] = time.monotonic() - t0

    thread = threading.Thread(target=join)
    thread.start()
    t0 = time.monotonic()
    assert post(server, "/generate", {"text": "hi", "sampling_params": GREEDY}).status_code == 200
    assert time.monotonic() - t0 < 3
    thread.join(timeout=60)
    assert_400(result["reply"], str(port))
    assert 2.5 < result["s"] < 10  # the configured connect timeout, not the 300 s collective one


def test_nccl_on_a_cpu_server_is_400_naming_backend(server):
    if server.engine.config.device != "cpu":
        pytest.skip("a CPU server's refusal")
    reply = post(server, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": free_port(),
                                                          "rank_offset": 1, "world_size": 2, "backend": "nccl"})
    assert_400(reply, "backend", "nccl")
    reply = post(server, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": free_port(),
                                                          "rank_offset": 1, "world_size": 2, "backend": "mpi"})
    assert_400(reply, "backend")


def test_distributed_update_with_absurd_shapes_is_400_before_any_receive(server):
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[-4]]}
    assert_400(post(server, "/update_weights_from_distributed", body), "shapes[0]")
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[1 << 40, 1 << 40]]}
    assert_400(post(server, "/update_weights_from_distributed", body), "shapes[0]")
    body = {"names": ["model.norm.weight"], "dtypes": ["no_such_dtype"], "shapes": [[4]]}
    assert_400(post(server, "/update_weights_from_distributed", body), "dtypes[0]")
