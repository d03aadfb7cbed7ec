"""``python -m course_lib serve`` as a real subprocess: it prints where it listens, guards its
routes with the API key, takes a bucketed IPC update from this (another) process through
shared memory, serves the new weights exactly as a cold engine would, and stops on SIGTERM."""
import os
import select
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from course_lib import Engine  # noqa: E402
from course_lib.server.client import EngineClient, EngineError  # noqa: E402
from course_lib.weights.checkpoint import CheckpointReader  # noqa: E402

KEY = "cli-key"
PROMPTS = ["from the command line", "served hot"]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def read_line(proc, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.1)[0]:
            return proc.stdout.readline()
        if proc.poll() is not None:
            break
    stderr = proc.stderr.read() if proc.poll() is not None else ""
    raise AssertionError(f"server printed no address (exit code {proc.poll()}): {stderr}")


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    return make_ckpt("tiny", seed=71), make_ckpt("tiny", seed=72)


def test_serve_command(ckpts):
    old, new = ckpts
    env = dict(os.environ, COURSE_LIB_API_KEY="")
    proc = subprocess.Popen([sys.executable, "-m", "course_lib", "serve", "--model", str(old), "--port", "0",
                             "--allow-weight-update", "--api-key", KEY, "--device", "cpu", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = read_line(proc, timeout=60)
        url = line.split(" on ", 1)[1].split()[0]
        assert url.startswith("http://127.0.0.1:") and "API key required" in line
        assert httpx.get(f"{url}/health").json()["healthy"]
        assert httpx.get(f"{url}/get_weight_version").status_code == 401
        with EngineClient(url, api_key=KEY) as client:
            before = client.generate(text=PROMPTS, sampling_params=GREEDY)
            assert [o["output_ids"] for o in before] == [o["output_ids"] for o in Engine(old).generate(PROMPTS, GREEDY)]
            times = client.sync_weights(named_tensors=CheckpointReader(new).iter_tensors(), weight_version="cli-1",
                                        bucket_bytes=100_000, flush_interval_s=0.01)
            assert times["buckets"] > 1
            assert client.get_weight_version() == {"weight_version": "cli-1", "weight_update_count": times["buckets"]}
            after = client.generate(text=PROMPTS, sampling_params=GREEDY)
            assert [o["output_ids"] for o in after] == [o["output_ids"] for o in Engine(new).generate(PROMPTS, GREEDY)]
            assert all(o["meta_info"]["weight_versions"] == [{"version": "cli-1", "start": 0, "end": 8}] for o in after)
        with EngineClient(url, api_key="wrong") as client, pytest.raises(EngineError, match="403 forbidden"):
            client.get_weight_version()
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal so the parent sees it.
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
