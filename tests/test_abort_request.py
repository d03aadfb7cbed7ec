"""Engine.abort_request: one request ended now, its output out of the next step(); the
others run on. A step that fails loses no output that was waiting to be handed back."""
import pytest

from course_lib import Engine

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return make_ckpt("tiny", seed=97)


def test_abort_request_ends_one_request_and_frees_its_blocks(ckpt):
    engine = Engine(ckpt)
    free = engine.block_manager.num_free_blocks
    keep, drop = engine.add_request("keep going", GREEDY), engine.add_request("stop me", GREEDY)
    engine.step()
    engine.step()
    assert engine.abort_request(drop, "the client went away")
    assert drop not in engine.requests and not engine.abort_request(drop, "twice")  # finished already
    outputs = engine.step()
    aborted = [o for o in outputs if o["rid"] == drop]
    assert aborted and aborted[0]["meta_info"]["finish_reason"] == {"type": "abort", "message": "the client went away"}
    assert 0 < aborted[0]["meta_info"]["completion_tokens"] < GREEDY["max_new_tokens"]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o["rid"]: o for o in engine.step()})
    assert done[keep]["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
    assert engine.block_manager.num_free_blocks == free


def test_abort_request_of_a_queued_request_and_bad_arguments(ckpt):
    engine = Engine(ckpt)
    rid = engine.add_request("queued", GREEDY)
    assert engine.abort_request(rid, "step failed", reason_type="error")
    [out] = engine.step()
    assert out["meta_info"]["finish_reason"]["type"] == "error" and out["output_ids"] == []
    assert not engine.abort_request("no-such-request", "x")
    with pytest.raises(ValueError, match="reason_type"):
        engine.abort_request(rid, "x", reason_type="stop")
    with pytest.raises(ValueError, match="message"):
        engine.abort_request(rid, 3)


def test_a_failed_step_keeps_the_outputs_it_had_to_hand_back(ckpt, monkeypatch):
    engine = Engine(ckpt)
    rid = engine.add_request("aborted", GREEDY)
    engine.add_request("running", GREEDY)
    engine.abort_request(rid, "gone")

    def fail(*args, **kwargs):
        raise RuntimeError("the step failed")
    monkeypatch.setattr(engine.model_runner, "run", fail)
    with pytest.raises(RuntimeError, match="the step failed"):
        engine.step()
    monkeypatch.undo()
    assert rid in [o["rid"] for o in engine.step()]
