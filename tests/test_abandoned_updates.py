"""A trainer killed with weight updates in flight: what it sent and nobody waits for any more
is not applied. Over a real server: a real trainer process posts buckets while the engine
thread is busy, is killed (SIGKILL: the kernel closes its connections), and the engine,
once free, finds those updates cancelled; the weights, version and update count are those
from before, and a live trainer's next update lands as usual."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
import torch  # noqa: E402

from course_lib import Engine  # noqa: E402
from course_lib.server.runner import BackgroundServer  # noqa: E402
from course_lib.weights.transports import safe_pickle  # noqa: E402

NAME = "model.norm.weight"

# The trainer: send each body as its own POST and never read a reply (it is killed first).
TRAINER = """
import http.client, sys, time
host, port, *bodies = sys.argv[1:]
conns = []
for path in bodies:
    body = open(path, "rb").read()
    conn = http.client.HTTPConnection(host, int(port))
    conn.request("POST", "/update_weights_from_tensor", body, {"Content-Type": "application/json"})
    conns.append(conn)
print("sent", flush=True)
time.sleep(120)
"""


def record_submissions(srv) -> list:
    """The futures of every command handed to the engine thread from now on (the server's
    own worker, its ``submit`` wrapped to keep them), so the test sees when the trainer's
    updates wait in line and whether they were cancelled."""
    futures, submit = [], srv.worker.submit

    def recording(fn):
        futures.append(submit(fn))
        return futures[-1]
    srv.worker.submit = recording
    return futures


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_killed_trainers_queued_updates_are_not_applied(make_ckpt, tmp_path):
    with BackgroundServer(Engine(make_ckpt("tiny", seed=83)), allow_weight_update=True) as srv:
        shape, before, count = srv.worker.call_sync(lambda e: (
            tuple(e.get_weights_by_name(NAME, 10 ** 9).shape), e.get_weights_by_name(NAME, 10 ** 9).clone(),
            e.weight_update_count))
        bodies = []
        for i in range(3):
            payload = safe_pickle.serialize([(NAME, torch.full(shape, float(i + 2)))])
            path = tmp_path / f"bucket{i}.json"
            path.write_text(json.dumps({"serialized_named_tensors": [payload], "flush_cache": False}))
            bodies.append(str(path))

        gate = threading.Event()
        srv.worker.submit(lambda e: gate.wait(60))  # the engine thread is busy: what arrives waits in line
        queued = record_submissions(srv)
        host, port = srv.url.removeprefix("http://").split(":")
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, host, port, *bodies],
                                   stdout=subprocess.PIPE, text=True)
        try:
            assert trainer.stdout.readline().strip() == "sent"
            wait_for(lambda: len(queued) == 3, "the trainer's three updates never reached the engine's queue")
            os.kill(trainer.pid, signal.SIGKILL)
            trainer.wait(30)
            wait_for(lambda: all(future.cancelled() for future in queued),
                     "the killed trainer's updates were not cancelled")
        finally:
            gate.set()
            if trainer.poll() is None:
                trainer.kill()

        after, after_count, version = srv.worker.call_sync(lambda e: (
            e.get_weights_by_name(NAME, 10 ** 9).clone(), e.weight_update_count, e.weight_version), timeout=60)
        assert torch.equal(after, before), "an update sent by a killed trainer was applied"
        assert after_count == count and version == "default"

        # A live trainer's update still lands.
        payload = safe_pickle.serialize([(NAME, torch.full(shape, 7.0))])
        reply = httpx.post(f"{srv.url}/update_weights_from_tensor", timeout=60,
                           json={"serialized_named_tensors": [payload], "weight_version": "v2"})
        assert reply.status_code == 200, reply.text
        now = srv.worker.call_sync(lambda e: e.get_weights_by_name(NAME, 10 ** 9).clone())
        assert torch.equal(now, torch.full(shape, 7.0, dtype=now.dtype))
