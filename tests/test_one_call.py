"""One call per update (``update/one_call.py``, ``/sync_weights``): the pause, the update and
the continue in one request, with the separate calls' validation, refusals and rollback."""
import pytest

from course_lib import Engine
from course_lib.testing import assert_addresses_unchanged, assert_hot_equals_cold
from course_lib.weights.checkpoint import CheckpointReader
from course_lib.weights.commit.validate import UpdateError

PROMPTS = ["one call per update", "pause, update, continue"]
RUNNING = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    return make_ckpt("tiny", seed=61), make_ckpt("tiny", seed=62), make_ckpt("tiny", seed=63, num_hidden_layers=3)


def busy_engine(path) -> tuple[Engine, list[str]]:
    engine = Engine(path, max_model_len=128)
    rids = [engine.add_request(p, RUNNING) for p in PROMPTS]
    engine.step()
    engine.step()
    return engine, rids


@pytest.mark.parametrize("mode", ["retract", "keep", "wait", "abort"])
def test_one_call_pauses_updates_and_continues(ckpts, mode):
    a, b, _ = ckpts
    engine, rids = busy_engine(a)
    result = engine.update_weights_from_disk(b, weight_version="v2", pause_mode=mode)
    assert not engine.paused and engine.weight_version == "v2"
    timings = result["timings_ms"]
    assert next(iter(timings)) == "pause" and list(timings)[-1] == "continue"
    assert result["elapsed_ms"] == pytest.approx(sum(timings.values()))
    assert result["num_aborted_requests"] == (len(rids) if mode == "abort" else 0)
    assert engine.pause_stats[-1].mode == mode and engine.pause_stats[-1].updates == 1
    while engine.has_unfinished_requests():  # the requests in flight go on with the new weights
        engine.step()
    assert_hot_equals_cold(engine, b, PROMPTS, max_new_tokens=4)
    assert_addresses_unchanged(engine)


def test_without_a_pause_a_busy_engine_still_refuses(ckpts):
    a, b, _ = ckpts
    engine, _ = busy_engine(a)
    with pytest.raises(RuntimeError, match="not paused"):
        engine.update_weights_from_disk(b)
    assert engine.weight_update_count == 0


def test_a_refused_one_call_changes_nothing_and_serves_on(ckpts):
    a, _, other = ckpts
    engine, _ = busy_engine(a)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(UpdateError, match="structure"):
        engine.update_weights_from_disk(other, pause_mode="retract")
    assert not engine.paused, "nothing changed: the old weights serve again"
    assert all(v.equal(before[k]) for k, v in engine.model.state_dict().items())
    assert engine.weight_update_count == 0 and engine.health()["healthy"]


def test_an_update_in_several_messages_pauses_on_the_first_and_continues_on_the_last(ckpts):
    a, b, _ = ckpts
    engine, _ = busy_engine(a)
    pairs = list(CheckpointReader(b).iter_tensors())
    half = len(pairs) // 2
    engine.update_weights_from_tensor(pairs[:half], pause_mode="retract", resume=False)
    assert engine.paused
    engine.update_weights_from_tensor(pairs[half:-1])
    assert engine.paused
    result = engine.update_weights_from_tensor(pairs[-1:], weight_version="v2", resume=True)
    assert not engine.paused and "continue" in result["timings_ms"] and "pause" not in result["timings_ms"]
    assert engine.pause_stats[-1].updates == 3
    assert_hot_equals_cold(engine, b, PROMPTS, max_new_tokens=4)


def test_a_failed_later_message_leaves_the_engine_paused(ckpts):
    """Once a message of this pause changed weights, a failed one must not let a mix serve."""
    a, b, _ = ckpts
    engine, _ = busy_engine(a)
    pairs = list(CheckpointReader(b).iter_tensors())
    engine.update_weights_from_tensor(pairs[:3], pause_mode="keep", resume=False)
    name, t = pairs[3]
    with pytest.raises(UpdateError):
        engine.update_weights_from_tensor([(name, t[:1])], resume=True)  # the wrong shape: refused
    assert engine.paused, "a mix of two versions must not serve"


def test_over_http_one_request_carries_the_update_and_the_pause(ckpts):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from course_lib.server.client import EngineClient, EngineError
    from course_lib.server.runner import BackgroundServer

    a, b, _ = ckpts
    with BackgroundServer(Engine(a, max_model_len=128), allow_weight_update=True) as server, \
            EngineClient(server.url) as client:
        assert client.offers_one_call()
        reply = client.update_in_one_call("disk", pause_mode="retract", model_path=str(b), weight_version="v2")
        assert reply["success"] and "pause" in reply["timings_ms"] and "continue" in reply["timings_ms"]
        health = client.health()
        assert not health["paused"] and health["weight_version"] == "v2"
        with pytest.raises(EngineError) as bad:
            client.update_in_one_call("carrier-pigeon", pause_mode="retract")
        assert bad.value.status == 422
        with pytest.raises(EngineError) as missing:  # the disk route's own checks, in one call too
            client.update_in_one_call("disk", pause_mode="retract", model_path=str(a) + "-absent")
        assert missing.value.status == 400 and not client.health()["paused"]
        server.worker.call_sync(lambda e: assert_hot_equals_cold(e, b, PROMPTS, max_new_tokens=4), timeout=60)
    with BackgroundServer(Engine(a, max_model_len=128), allow_weight_update=False) as closed:  # refused as the others
        assert httpx.post(f"{closed.url}/sync_weights", json={"transport": "disk"}).status_code == 403
