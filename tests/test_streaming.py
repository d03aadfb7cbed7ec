"""Streaming /generate over a real HTTP server on 127.0.0.1: SGLang's server-sent events
(cumulative text and output_ids per event, then [DONE]) add up to exactly the whole
output, carry every token's weight version across a hot update, abort their requests when
the client leaves, and pass the same checks (API key, paused, bad prompts) as whole replies."""
import json
import random
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from course_lib import Engine  # noqa: E402
from course_lib.server.client import EngineClient  # noqa: E402
from course_lib.server.runner import BackgroundServer  # noqa: E402
from course_lib.server.streaming import RequestStream  # noqa: E402
from course_lib.tokenizer import ByteTokenizer  # noqa: E402

GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 900, "temperature": 0, "ignore_eos": True}
PROMPTS = ["stream me", "a second, longer prompt to stream", "é and 🙂 in the prompt"]
KEY = "stream-key"


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    return make_ckpt("tiny", seed=61), make_ckpt("tiny", seed=62)


@pytest.fixture
def server(ckpts):
    with BackgroundServer(Engine(ckpts[0]), allow_weight_update=True) as srv:
        yield srv


def events_of(response) -> list:
    """The decoded events of an SSE body; the last must be [DONE], and nothing follows it."""
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def stream(url: str, body: dict, headers=None) -> list:
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return events_of(r)


def without_timing(out: dict) -> dict:
    """An output minus what differs between two runs of the same request: its id, its
    latency and its prefix-cache hits (the second run finds the first one's prompt)."""
    meta = {k: v for k, v in out["meta_info"].items() if k not in ("id", "e2e_latency", "cached_tokens")}
    return {**out, "meta_info": meta}


def whole(url: str, body: dict):
    """The non-streaming reply, then an empty prefix cache: the streamed run that follows
    computes its prompt again, as this one did (a cache hit changes logprobs' last bits)."""
    out = httpx.post(f"{url}/generate", json=body, timeout=60).json()
    assert httpx.get(f"{url}/flush_cache").status_code == 200
    return out


def assert_adds_up(events: list, whole: dict) -> None:
    """Each event extends the one before; the differences add up to the whole output."""
    text, ids = "", []
    for ev in events[:-1]:
        assert ev["meta_info"]["finish_reason"] is None
        assert ev["text"].startswith(text) and ev["output_ids"][:len(ids)] == ids and len(ev["output_ids"]) > len(ids)
        text, ids = ev["text"], ev["output_ids"]
        assert ev["meta_info"]["completion_tokens"] == len(ids)
        assert ev["meta_info"]["weight_version"] == ev["meta_info"]["weight_versions"][-1]["version"]
        assert ev["meta_info"]["weight_versions"][-1]["end"] == len(ids)
    last = events[-1]
    assert last["text"].startswith(text) and last["output_ids"][:len(ids)] == ids
    assert last["meta_info"]["finish_reason"] is not None
    assert without_timing(last) == without_timing(whole)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_events_add_up_to_the_whole_output(server, prompt):
    body = {"text": prompt, "sampling_params": GREEDY}
    out = whole(server.url, body)
    events = stream(server.url, body)
    assert len(events) >= 2
    assert_adds_up(events, out)


def test_a_streamed_batch_adds_up_per_index_with_logprobs(server):
    body = {"text": PROMPTS, "sampling_params": GREEDY, "return_logprob": True}
    outs = whole(server.url, body)
    events = stream(server.url, body)
    assert {ev["index"] for ev in events} == set(range(len(PROMPTS)))
    for i, out in enumerate(outs):
        mine = [{k: v for k, v in ev.items() if k != "index"} for ev in events if ev["index"] == i]
        assert_adds_up(mine, out)
        for ev in mine:  # logprobs grow with the tokens, one [logprob, id, null] each
            logprobs = ev["meta_info"]["output_token_logprobs"]
            assert [t for _, t, _ in logprobs] == ev["output_ids"]


def test_versions_are_per_token_across_an_update(server, ckpts):
    """A stream frozen mid-way (keep mode) while new weights land goes on with the new
    version: its events say which version made each token, and agree with the whole output."""
    body = {"text": "versions per token", "sampling_params": {**GREEDY, "max_new_tokens": 300}}
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}, timeout=60) as r, \
            EngineClient(server.url) as client:
        lines = r.iter_lines()
        first = json.loads(next(lines)[len("data: "):])
        assert first["meta_info"]["weight_version"] == "default"
        client.pause_generation("keep")
        client.update_weights_from_disk(ckpts[1], weight_version="v2")
        client.continue_generation()
        events = [first] + [json.loads(line[len("data: "):]) for line in lines if line and line != "data: [DONE]"]
    final = events[-1]["meta_info"]
    spans = final["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "v2"] and spans[-1]["end"] == final["completion_tokens"]
    old = spans[0]["end"]
    assert 0 < first["meta_info"]["completion_tokens"] <= old
    for ev in events[:-1]:  # every event's spans are the final spans cut at its length
        n = ev["meta_info"]["completion_tokens"]
        cut = [{**s, "end": min(s["end"], n)} for s in spans if s["start"] < n]
        assert ev["meta_info"]["weight_versions"] == cut
        assert ev["meta_info"]["weight_version"] == ("default" if n <= old else "v2")


def test_a_client_that_disconnects_mid_stream_has_its_request_aborted(server):
    """The request is frozen (keep mode: it cannot finish by itself); the client leaves;
    the request is gone from the engine while generation is still paused."""
    with EngineClient(server.url) as client:
        with httpx.stream("POST", f"{server.url}/generate", json={"text": "leave early", "sampling_params": LONG,
                                                                   "stream": True}, timeout=60) as r:
            lines = r.iter_lines()  # kept: a closed line iterator closes the connection
            assert next(lines).startswith("data: ")
            client.pause_generation("keep")
            assert server.worker.call_sync(lambda e: len(e.requests), timeout=10) == 1
        for _ in range(200):  # bounded: 10 s
            if server.worker.call_sync(lambda e: len(e.requests), timeout=10) == 0:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the request of a client that left was never aborted")
        assert client.health()["paused"] is True
        client.continue_generation()


def test_a_pause_in_abort_mode_ends_the_stream_with_its_reason(server):
    with httpx.stream("POST", f"{server.url}/generate", json={"text": "aborted", "sampling_params": LONG,
                                                               "stream": True}, timeout=60) as r, \
            EngineClient(server.url) as client:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        client.pause_generation("abort")
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2][len("data: "):])
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert "pause" in last["meta_info"]["finish_reason"]["message"]


def test_refusals_are_plain_error_replies(server):
    url = server.url
    with EngineClient(url) as client:
        reply = httpx.post(f"{url}/generate", json={"text": "", "stream": True})
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "bad_request"
        client.pause_generation("abort")
        reply = httpx.post(f"{url}/generate", json={"text": "paused", "stream": True})
        assert reply.status_code == 503 and reply.json()["error"] == {
            "code": "paused", "message": reply.json()["error"]["message"], "retryable": True, "status": 503}
        client.continue_generation()
        assert server.worker.call_sync(lambda e: len(e.requests), timeout=10) == 0  # nothing was queued


def test_streaming_needs_the_api_key(ckpts):
    with BackgroundServer(Engine(ckpts[0]), api_key=KEY) as srv:
        body = {"text": "keyed", "sampling_params": GREEDY, "stream": True}
        assert httpx.post(f"{srv.url}/generate", json=body).status_code == 401
        assert httpx.post(f"{srv.url}/generate", json=body, headers={"X-API-Key": "wrong"}).status_code == 403
        events = stream(srv.url, body, headers={"Authorization": f"Bearer {KEY}"})
        assert events[-1]["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]


def test_event_text_is_always_a_prefix_of_the_final_text():
    """Random ids, heavy in multi-byte UTF-8 pieces and ids that are not bytes, fed in
    random chunks: each event's text extends the last, and ends as the tokenizer's text."""
    tok = ByteTokenizer(512, 256, 257)
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    pieces = [0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98, 0x80, 0xBF, 0xFF, 300, 65]
    for _ in range(2000):
        ids = [rng.choice(pieces) if rng.random() < 0.8 else rng.randrange(512) for _ in range(rng.randrange(1, 40))]
        s, shown, i = RequestStream(0, tok.decode, False), "", 0
        while i < len(ids):
            n = rng.randrange(1, 4)
            s.add({"rid": "r", "prompt_tokens": 1, "ids": ids[i:i + n], "versions": ["v"] * len(ids[i:i + n]),
                   "logprobs": None})
            i += n
            assert s.text().startswith(shown), (ids, shown, s.text())
            shown = s.text()
        assert tok.decode(ids).startswith(shown)
        assert s.settled_text + tok.decode(s.ids[s.settled_ids:]) == tok.decode(ids), ids
