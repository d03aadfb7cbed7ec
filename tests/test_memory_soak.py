"""The long soak: at least 1,000 weight updates over a real server while clients generate
without pause; memory measured per engine step and per update (Python allocations traced,
with the ring buffers full), every token checked against cold engines, hot == cold at the end.

The ring buffers (history.py) are made small here so they fill during the warm-up:
what is measured afterwards is any growth beyond them, which must be none (<= 100 bytes per
step and per update, the whole growth charged to each). Pause modes abort and wait finish
every reply on one version; its tokens must equal what a cold engine on that version's
checkpoint generates (a stale token is one that differs).
"""
import gc
import os
import threading
import time
import tracemalloc

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from course_lib import Engine  # noqa: E402
from course_lib.engine import engine as engine_module  # noqa: E402
from course_lib.engine import pause as pause_module  # noqa: E402
from course_lib.update import updater as updater_module  # noqa: E402
from course_lib.server.client import EngineClient, EngineError  # noqa: E402
from course_lib.server.runner import BackgroundServer  # noqa: E402
from course_lib.testing import assert_hot_equals_cold  # noqa: E402
from course_lib.weights.checkpoint import CheckpointReader  # noqa: E402

UPDATES = int(os.environ.get("SOAK_UPDATES", "1000"))
WARMUP = 200
CLIENTS = 4
PROMPTS = ["soak", "a longer soak prompt", "flat memory"]
LENGTHS = [4, 6, 8]
MAX_BYTES = 100  # per step and per update


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_soak_memory_is_flat_and_no_token_is_stale(make_ckpt, monkeypatch):
    monkeypatch.setattr(engine_module, "STEP_LOG_SIZE", 64)
    monkeypatch.setattr(updater_module, "UPDATE_HISTORY_SIZE", 16)
    monkeypatch.setattr(pause_module, "PAUSE_STATS_SIZE", 16)
    ckpts = make_ckpt("tiny", seed=71), make_ckpt("tiny", seed=72)
    reference = {}  # (checkpoint, prompt, length) -> the greedy tokens a cold engine generates
    for path in ckpts:
        cold = Engine(path)
        for prompt in PROMPTS:
            for n in LENGTHS:
                reference[path, prompt, n] = cold.generate(prompt, greedy(n))[0]["output_ids"]
    tensors = {path: list(CheckpointReader(path).iter_tensors()) for path in ckpts}
    counts = {"replies": 0, "tokens": 0, "stale": 0, "aborted": 0, "early": 0}
    failures, stop = [], threading.Event()
    # Memory is read with the clients quiet (no request in flight): buffers of requests
    # in flight come and go by tens of kilobytes, far above what is being measured.
    go, in_flight = threading.Event(), threading.Semaphore(CLIENTS)
    go.set()
    # Version "v{k}" is checkpoint k % 2 ("default": the first). Only integers are kept
    # per update, so the test's own bookkeeping does not grow with the updates it counts.
    committed = [0]  # the number of the newest update fully applied

    def client_loop(server, i):
        with EngineClient(server.url, timeout=120) as client:
            n = 0
            while not stop.is_set():
                go.wait()
                prompt, length = PROMPTS[(i + n) % 3], LENGTHS[(i + 2 * n) % 3]
                floor = committed[0]  # every update applied before the request was sent
                with in_flight:
                    try:
                        reply = client.generate(text=prompt, sampling_params=greedy(length), retry_paused_s=60)
                    except EngineError as exc:
                        failures.append(exc)
                        return
                n += 1
                check(reply, prompt, length, floor)

    def check(reply, prompt, length, floor):
        meta = reply["meta_info"]
        counts["replies"] += 1
        if meta["finish_reason"]["type"] == "abort":
            counts["aborted"] += 1
            return
        [span] = meta["weight_versions"]  # abort and wait modes never mix versions in a reply
        number = 0 if span["version"] == "default" else int(span["version"][1:])
        counts["tokens"] += len(reply["output_ids"])
        counts["early"] += number < floor  # served by a version already replaced
        want = reference[ckpts[number % 2], prompt, length]
        got = reply["output_ids"]
        counts["stale"] += sum(x != y for x, y in zip(got, want)) + abs(len(want) - len(got))

    tracemalloc.start()
    with BackgroundServer(Engine(ckpts[0]), allow_weight_update=True) as server:
        threads = [threading.Thread(target=client_loop, args=(server, i), daemon=True) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        marks = {}
        try:
            with EngineClient(server.url, timeout=120) as trainer:
                for k in range(1, WARMUP + UPDATES + 1):
                    if k == WARMUP + 1:
                        marks["start"] = measure(server, go, in_flight)
                    version, path = f"v{k}", ckpts[k % 2]
                    mode = "wait" if k % 3 == 0 else "abort"
                    if k % 2:
                        trainer.sync_weights(named_tensors=tensors[path], weight_version=version, pause_mode=mode,
                                             bucket_bytes=1 << 20, flush_interval_s=0.005, flush_tries=10_000)
                    else:
                        trainer.sync_weights(model_path=path, weight_version=version, pause_mode=mode,
                                             flush_interval_s=0.005, flush_tries=10_000)
                    committed[0] = k
                    time.sleep(0.01)  # the clients' turn: steps between the updates
                marks["end"] = measure(server, go, in_flight)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=120)
        tracemalloc.stop()
        assert not failures, failures[:3]
        last = ckpts[(WARMUP + UPDATES) % 2]
        server.worker.call_sync(lambda e: assert_hot_equals_cold(e, last, PROMPTS), timeout=120)

    start, end = marks["start"], marks["end"]
    steps, updates = end["steps"] - start["steps"], end["updates"] - start["updates"]
    growth = end["traced"] - start["traced"]
    per_step, per_update = growth / max(steps, 1), growth / max(updates, 1)
    print(f"\nsoak: {updates} updates, {steps} steps, {counts['replies']} replies ({counts['aborted']} aborted), "
          f"{counts['tokens']} tokens checked, {counts['stale']} stale; traced growth {growth} B = "
          f"{per_step:.2f} B/step, {per_update:.2f} B/update; RSS growth {(end['rss'] - start['rss']) >> 10} KiB")
    assert updates >= 1000 or UPDATES < 1000
    assert counts["stale"] == 0 and counts["early"] == 0, counts
    assert counts["tokens"] > 0 and steps > updates
    assert per_step <= MAX_BYTES and per_update <= MAX_BYTES, (growth, steps, updates)
    assert end["rss"] - start["rss"] < 64 << 20  # no tensor kept per update (those are not traced)


def greedy(n):
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def measure(server, go, in_flight) -> dict:
    go.clear()
    for _ in range(CLIENTS):  # every client between two requests
        in_flight.acquire()

    def read(engine):
        gc.collect()
        if os.environ.get("SOAK_DEBUG"):
            snap = tracemalloc.take_snapshot()
            if getattr(measure, "snap", None) is not None:
                stats = snap.compare_to(measure.snap, "lineno")
                print("sum of differences", sum(s.size_diff for s in stats))
                for stat in sorted(stats, key=lambda s: -s.size_diff)[:12]:
                    print(stat)
            measure.snap = snap
        return {"steps": engine.num_steps, "updates": engine.weight_update_count,
                "traced": tracemalloc.get_traced_memory()[0], "rss": rss_bytes()}
    try:
        return server.worker.call_sync(read, timeout=120)
    finally:
        for _ in range(CLIENTS):
            in_flight.release()
        go.set()
