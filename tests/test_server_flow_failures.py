"""The server and client when something in the middle fails: a broken error translation
never stops the engine loop, and the trainer's flow continues only when no weight changed."""
import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from course_lib import Engine  # noqa: E402
from course_lib.server import worker as worker_module  # noqa: E402
from course_lib.server.client import EngineClient, EngineError  # noqa: E402
from course_lib.server.runner import BackgroundServer  # noqa: E402
from course_lib.testing import assert_hot_equals_cold  # noqa: E402
from course_lib.weights.checkpoint import CheckpointReader  # noqa: E402


def test_a_translation_that_raises_is_a_500_and_the_loop_keeps_serving(tiny_ckpt, monkeypatch):
    def unwritten(exc, engine):
        raise NotImplementedError("ch07.error_status: write this part")
    monkeypatch.setattr(worker_module, "from_engine_exception", unwritten)
    with BackgroundServer(Engine(tiny_ckpt)) as srv, EngineClient(srv.url) as c:
        c.pause_generation()
        reply = httpx.post(f"{srv.url}/generate", json={"text": "hi"})  # EnginePausedError on the engine thread
        assert reply.status_code == 500 and "ch07.error_status: write this part" in reply.json()["error"]["message"]
        c.continue_generation()
        assert srv.worker.alive and c.health()["healthy"]
        assert len(c.generate(text="still serving", sampling_params={"max_new_tokens": 2})["output_ids"]) == 2


def test_the_flow_continues_after_a_refused_first_bucket_and_not_after_a_later_one(make_ckpt):
    old, new = make_ckpt("tiny", seed=81), make_ckpt("tiny", seed=82)
    tensors = list(CheckpointReader(new).iter_tensors())
    with BackgroundServer(Engine(old)) as srv, EngineClient(srv.url) as c:
        name, t = tensors[0]
        with pytest.raises(EngineError, match="400"):
            c.sync_weights(named_tensors=[(name, t.reshape(-1))] + tensors[1:], bucket_bytes=60_000,
                           flush_interval_s=0.01)
        assert c.health()["paused"] is False
        srv.worker.call_sync(lambda e: assert_hot_equals_cold(e, old, ["nothing changed"], max_new_tokens=4))
        name, t = tensors[-1]
        with pytest.raises(EngineError, match="400"):
            c.sync_weights(named_tensors=tensors[:-1] + [(name, t[:1])], bucket_bytes=60_000, flush_interval_s=0.01)
        assert c.health()["paused"] is True
        c.sync_weights(named_tensors=tensors, weight_version="v1", bucket_bytes=60_000, flush_interval_s=0.01)
        assert c.health()["paused"] is False and c.get_weight_version()["weight_version"] == "v1"
        srv.worker.call_sync(lambda e: assert_hot_equals_cold(e, new, ["resent"], max_new_tokens=4))
