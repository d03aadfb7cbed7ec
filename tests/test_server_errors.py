"""Refusals that depend on the engine's state (409, 503, 400 flush) and hostile inputs: each is
refused with its documented code, and the weights and version read back unchanged."""
import base64
import pickle
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
import torch  # noqa: E402

from course_lib import Engine  # noqa: E402
from course_lib.server.client import EngineClient, EngineError  # noqa: E402
from course_lib.server.runner import BackgroundServer  # noqa: E402
from course_lib.weights.transports import bucket, safe_pickle  # noqa: E402
from course_lib.weights.checkpoint import CheckpointReader  # noqa: E402

LONG = {"max_new_tokens": 900, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    return make_ckpt("tiny", seed=41), make_ckpt("tiny", seed=42)


@pytest.fixture
def server(ckpts):
    with BackgroundServer(Engine(ckpts[0]), allow_weight_update=True) as srv:
        yield srv


@pytest.fixture
def client(server):
    with EngineClient(server.url) as c:
        yield c


def refused(call, status: int, code: str) -> EngineError:
    with pytest.raises(EngineError) as info:
        call()
    assert (info.value.status, info.value.code) == (status, code), info.value
    return info.value


def fingerprint(client, names) -> tuple:
    """What must not change when a request is refused: every weight's values and the version."""
    return client.get_weight_version(), {n: client.get_weights_by_name(n, truncate_size=10_000) for n in names}


@pytest.fixture(scope="module")
def names(ckpts):
    return sorted(CheckpointReader(ckpts[0]).metadata())


class InFlight:
    """A long /generate running in a thread; ended (pause abort, continue) on exit."""

    def __init__(self, server, client):
        self.server, self.client, self.reply = server, client, None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with EngineClient(self.server.url) as c:
            self.reply = c.generate(text="a long request", sampling_params=LONG)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while self.client.health()["num_running"] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.005)
        return self

    def __exit__(self, *exc):
        if self.thread.is_alive():
            self.client.pause_generation("abort")
            self.client.continue_generation()
        self.thread.join(timeout=30)


def test_update_while_serving_unpaused_is_409_conflict(server, client, ckpts, names):
    before = fingerprint(client, names[:3])
    with InFlight(server, client):
        err = refused(lambda: client.update_weights_from_disk(ckpts[1], weight_version="v2"), 409, "conflict")
        assert "pause_generation" in err.message and not err.retryable
        assert fingerprint(client, names[:3]) == before


def test_abort_all_requests_updates_while_serving(server, client, ckpts):
    with InFlight(server, client) as job:
        result = client.update_weights_from_disk(ckpts[1], weight_version="v2", abort_all_requests=True)
        job.thread.join(timeout=30)
    assert result["success"] and client.get_weight_version()["weight_version"] == "v2"
    assert job.reply["meta_info"]["finish_reason"]["type"] == "abort"
    assert job.reply["meta_info"]["weight_versions"][-1]["version"] == "default"


def test_generate_while_paused_is_503_paused_and_retryable(client):
    assert client.pause_generation("in_place") == {"paused": True, "mode": "keep", "num_aborted_requests": 0}
    err = refused(lambda: client.generate(text="hi"), 503, "paused")
    assert err.retryable
    client.continue_generation()
    assert client.generate(text="hi", sampling_params={"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_flush_while_serving_is_400_and_ok_once_paused(server, client):
    with InFlight(server, client):
        err = refused(client.flush_cache, 400, "requests_in_flight")
        assert err.retryable  # slime retries it until the pause has emptied the engine
        reply = httpx.post(f"{server.url}/flush_cache", json={"timeout": 5})  # accepted, never blocks
        assert reply.status_code == 400
        client.pause_generation("retract")
        assert client.flush_cache()["success"] is True
        client.continue_generation()


def test_unknown_weight_name_is_404(client, server):
    refused(lambda: client.get_weights_by_name("model.layers.0.no_such.weight"), 404, "not_found")
    reply = httpx.post(f"{server.url}/get_weights_by_name", json={"name": "lm_head.bias"})
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "not_found"


def test_get_weights_by_name_reads_the_first_rows(client, ckpts):
    want = dict(CheckpointReader(ckpts[0]).iter_tensors())["model.layers.1.self_attn.k_proj.weight"]
    got = client.get_weights_by_name("model.layers.1.self_attn.k_proj.weight", truncate_size=3)
    assert torch.equal(torch.tensor(got), want[:3].float())


# ---- hostile and malformed payloads ----------------------------------------------------------

class RunsCode:
    """A pickle that runs code when loaded: here it would only create a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def tensor_payloads(new_ckpt, marker) -> dict:
    tensors = list(CheckpointReader(new_ckpt).iter_tensors())
    good = bucket.pack(tensors[:3])
    meta = bucket.FlattenedTensorMetadata
    overrun = dict(good, metadata=[meta(m.name, m.shape, m.dtype, m.start_idx, m.end_idx + 10_000, m.numel)
                                   for m in good["metadata"]])
    wrong_numel = dict(good, metadata=[meta(m.name, torch.Size([3, 3]), m.dtype, m.start_idx, m.end_idx, m.numel)
                                       for m in good["metadata"]])
    # Good tensors first, one bad one last: the whole chunk is refused, not the part before it.
    unknown = bucket.pack(tensors[3:6] + [("model.layers.0.not_a_weight", torch.ones(4))])
    wrong_shape = tensors[3:6] + [("model.norm.weight", torch.ones(3))]
    return {
        "code-running pickle": ([base64.b64encode(pickle.dumps(RunsCode(marker))).decode()], "flattened_bucket"),
        "not base64": (["%%%not-base64%%%"], "flattened_bucket"),
        "offsets overrun the buffer": ([safe_pickle.serialize(overrun)], "flattened_bucket"),
        "shape disagrees with numel": ([safe_pickle.serialize(wrong_numel)], "flattened_bucket"),
        "unknown tensor name": ([safe_pickle.serialize(unknown)], "flattened_bucket"),
        "wrong shape": ([safe_pickle.serialize(wrong_shape)], None),
        "not pairs": ([safe_pickle.serialize([1, 2, 3])], None),
        "unknown load_format": ([safe_pickle.serialize([])], "zip"),
    }


@pytest.mark.parametrize("case", ["code-running pickle", "not base64", "offsets overrun the buffer",
                                  "shape disagrees with numel", "unknown tensor name", "wrong shape", "not pairs",
                                  "unknown load_format"])
def test_bad_tensor_payload_is_400_and_changes_nothing(client, ckpts, names, case, tmp_path):
    marker = tmp_path / "code-ran"
    payload, load_format = tensor_payloads(ckpts[1], marker)[case]
    client.pause_generation()
    before = fingerprint(client, names)
    err = refused(lambda: client.update_weights_from_tensor(payload, load_format=load_format, weight_version="evil"),
                  400, "unsafe_payload" if case in ("code-running pickle", "not base64") else "bad_request")
    assert not marker.exists(), "the pickle's code ran"
    assert fingerprint(client, names) == before
    assert client.get_weight_version()["weight_update_count"] == 0
    if case == "code-running pickle":
        assert "builtins.exec" in err.message


@pytest.mark.parametrize("path", ["../../etc", "/etc", "/no/such/dir", "relative/../../../etc/passwd", "a\x00b"])
def test_model_path_that_is_not_a_checkpoint_is_400(client, names, path):
    before = fingerprint(client, names)
    err = refused(lambda: client.update_weights_from_disk(path, weight_version="evil"), 400, "bad_model_path")
    assert "model_path" in err.message
    assert fingerprint(client, names) == before


def test_structural_mismatch_from_disk_is_400(client, names, make_ckpt):
    other = make_ckpt("tiny", seed=43, hidden_size=32, head_dim=8)
    before = fingerprint(client, names)
    err = refused(lambda: client.update_weights_from_disk(other, weight_version="v2"), 400, "bad_request")
    assert "structure" in err.message
    assert fingerprint(client, names) == before
