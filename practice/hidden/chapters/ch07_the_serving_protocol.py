"""Hidden tests for notebooks/07_the_serving_protocol.ipynb: the learner's RL flow against a real server.

``check_rl_sync(rl_sync)``: a ``BackgroundServer`` serves fresh random weights while
client threads generate without pause; the learner's ``rl_sync(client, named_tensors,
weight_version, bucket_bytes)`` pushes other fresh weights through the HTTP API. The
server refuses the first few flushes after the pause (as SGLang does while an abort is
still draining). Checked, in words: the order of the calls (pause, flush until 200,
every bucket with flush_cache=false, one flush, continue last), that no engine step ever
ran on a mix of two versions or under the wrong version label, every reply's version
spans, the version read back, and hot == cold afterwards.

Returns a list of failure messages (empty: passed); see ``__init__.py`` for why.
"""
from __future__ import annotations

import json
import os
import random
import tempfile
import threading
import time

import torch

from course_lib import Engine
from course_lib.layers.quant import kernel_tensors
from course_lib.server.client import EngineClient, EngineError
from course_lib.server.runner import BackgroundServer
from course_lib.testing import assert_hot_equals_cold
from course_lib.weights.checkpoint import CheckpointReader, make_random
from course_lib.weights.transports.ipc import group_into_buckets

UPDATE = "/update_weights_from_tensor"
FLUSH = "/flush_cache"


class FlowClient(EngineClient):
    """An EngineClient without the ready-made flow: the exercise is to write it."""

    def sync_weights(self, *args, **kwargs):
        raise NotImplementedError("client.sync_weights is the library's answer: call the endpoints yourself")

    def flush_until_done(self, *args, **kwargs):
        raise NotImplementedError("client.flush_until_done is the library's answer: write the retry loop yourself")


def _rng(seed) -> random.Random:
    return random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))


class Watch:
    """Instruments a served engine: which weights it holds after every update call, what
    each step ran on, and flush refusals injected after the pause."""

    def __init__(self, engine, old: dict, new: dict, refuse_flushes: int, version: str):
        self.engine, self.old, self.new, self.version = engine, old, new, version
        self.state = "old"
        self.steps = {"old": 0, "new": 0, "mixed": 0}
        self.problems: list[str] = []
        self.labels_at_updates: list[str] = []
        self.refuse_left = refuse_flushes
        self.flushes: list[bool] = []
        step, flush, update = engine.step, engine.flush_cache, engine.update_weights_from_tensor

        def watched_update(*args, **kwargs):
            try:
                return update(*args, **kwargs)
            finally:
                self.state = self.weights_state()
                self.labels_at_updates.append(engine.weight_version)

        def watched_step():
            runs = engine.has_unfinished_requests() and (not engine.paused or engine.pause_mode == "wait")
            if runs:
                self.steps[self.state] += 1
                label = engine.weight_version
                if self.state == "mixed":
                    self._once("an engine step ran while the weights were a mix of the old and the new "
                               "version (some buckets applied, not all): pause before the first bucket "
                               "and continue only after the last")
                elif self.state == "new" and label != self.version:
                    self._once(f"an engine step ran on the new weights under the label {label!r}: "
                               f"set the version {self.version!r} before continuing")
                elif self.state == "old" and label == self.version:
                    self._once(f"an engine step ran on the old weights under the new label {self.version!r}")
            return step()

        def watched_flush():
            if engine.paused and self.refuse_left > 0:  # SGLang: 400 until the abort has drained
                self.refuse_left -= 1
                self.flushes.append(False)
                return False
            ok = flush()
            self.flushes.append(ok)
            return ok

        engine.step, engine.flush_cache, engine.update_weights_from_tensor = watched_step, watched_flush, watched_update

    def _once(self, message: str) -> None:
        if message not in self.problems:
            self.problems.append(message)

    def weights_state(self) -> str:
        live = kernel_tensors(self.engine.model)
        if all(torch.equal(live[n], t) for n, t in self.old.items()):
            return "old"
        if all(torch.equal(live[n], t) for n, t in self.new.items()):
            return "new"
        return "mixed"


def _generate_forever(url: str, prompts, stop: threading.Event, replies: list, errors: list, i: int) -> None:
    with EngineClient(url, timeout=60) as client:
        n = 0
        while not stop.is_set():
            params = {"max_new_tokens": 10 + 6 * ((i + n) % 3), "temperature": 0, "ignore_eos": True}
            try:
                replies.append(client.generate(text=prompts[(i + n) % len(prompts)], sampling_params=params,
                                               retry_paused_s=20))
            except EngineError as exc:
                errors.append(f"{exc}")
                return
            n += 1


def _calls_problems(calls: list[tuple], n_buckets: int, refused: int) -> list[str]:
    """Failures of the call sequence (method, path, status, body) the learner's client made."""
    out = []
    paths = [p for _, p, _, _ in calls]
    if not calls or paths[0] != "/pause_generation":
        return [f"the first call must be POST /pause_generation; yours were {paths[:4]}"]
    updates = [i for i, p in enumerate(paths) if p == UPDATE]
    if not updates:
        return ["no POST /update_weights_from_tensor call: the weights were never sent"]
    flushes_before = [(i, s) for i, (_, p, s, _) in enumerate(calls) if p == FLUSH and i < updates[0]]
    if not any(s == 200 for _, s in flushes_before):
        out.append(f"after pausing, flush the cache until the server answers 200, before the first bucket "
                   f"(it answered 400 to the first {refused} tries, which the client must retry)")
    bad_flag = [k for k, i in enumerate(updates, 1) if calls[i][3].get("flush_cache", True) is not False]
    if bad_flag:
        out.append(f"bucket {bad_flag[0]} was sent without flush_cache=false: every bucket would flush "
                   f"again; send them all with flush_cache=false and flush once at the end")
    if any(calls[i][2] != 200 for i in updates):
        out.append("an update call was refused: " + next(f"status {calls[i][2]}" for i in updates if calls[i][2] != 200))
    if len(updates) < n_buckets:
        out.append(f"{len(updates)} update calls for weights that fill {n_buckets} buckets of bucket_bytes: "
                   f"group the tensors into buckets of about bucket_bytes each")
    formats = {calls[i][3].get("load_format") for i in updates}
    if formats != {"flattened_bucket"}:
        out.append(f"send each bucket with load_format='flattened_bucket' (got {sorted(map(str, formats))})")
    continues = [i for i, p in enumerate(paths) if p == "/continue_generation"]
    if not continues:
        out.append("POST /continue_generation was never called: the server stayed paused")
        return out
    last = continues[-1]
    if continues[0] < updates[-1] or any(p in (UPDATE, "/pause_generation") for p in paths[last:]):
        out.append("continue_generation must come after the last bucket, and be the last weight call")
    if not any(p == FLUSH and s == 200 for _, p, s, _ in calls[updates[-1] + 1:last]):
        out.append("flush the cache once (until it answers 200) after the last bucket and before continuing")
    return out


def check_rl_sync(rl_sync, seed=None) -> list[str]:
    """Failures of ``rl_sync(client, named_tensors, weight_version, bucket_bytes) -> dict`` on a live server."""
    rng = _rng(seed)
    version = f"step-{rng.randrange(1, 10_000)}"
    bucket_bytes = rng.choice([40_000, 60_000, 100_000])
    refused = rng.randint(1, 3)
    prompts = ["the policy answers: " + "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(20, 40)))
               for _ in range(3)]
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        old_path = make_random(f"{tmp}/old", "tiny", seed=rng.randrange(10_000))
        new_path = make_random(f"{tmp}/new", "tiny", seed=rng.randrange(10_000, 20_000))
        tensors = list(CheckpointReader(new_path).iter_tensors())
        n_buckets = sum(1 for _ in group_into_buckets(tensors, bucket_bytes))
        cold = Engine(new_path)
        new_weights = {n: t.clone() for n, t in kernel_tensors(cold.model).items()}
        engine = Engine(old_path)
        old_weights = {n: t.clone() for n, t in kernel_tensors(engine.model).items()}
        watch = Watch(engine, old_weights, new_weights, refused, version)
        replies, errors, stop = [], [], threading.Event()
        with BackgroundServer(engine, allow_weight_update=True) as server:
            threads = [threading.Thread(target=_generate_forever, args=(server.url, prompts, stop, replies, errors, i),
                                        daemon=True) for i in range(3)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 20
            while len(replies) < 2 and time.monotonic() < deadline and not errors:
                time.sleep(0.01)
            time.sleep(0.05)  # requests mid-decode when the flow starts
            calls = []
            client = FlowClient(server.url, timeout=60)

            def log(response):
                request = response.request
                body = json.loads(request.content) if request.content else {}
                calls.append((request.method, request.url.path, response.status_code, body))
            client.http.event_hooks["response"] = [log]
            try:  # the candidate first
                result = rl_sync(client, list(tensors), version, bucket_bytes)
            except Exception as exc:  # report, do not raise: see __init__.py
                failures.append(f"rl_sync raised {type(exc).__name__}: {exc}")
                result = None
            finally:
                client.close()
            still_paused = server.worker.call_sync(lambda e: e.paused, timeout=60)
            if still_paused:  # release the generating threads before judging
                server.worker.call_sync(lambda e: e.continue_generation(), timeout=60)
            time.sleep(0.1)  # some requests on the new weights
            stop.set()
            for t in threads:
                t.join(timeout=60)
            if failures:
                return failures
            if still_paused:
                failures.append("the server was still paused when rl_sync returned: call continue_generation")
            failures += _calls_problems(calls, n_buckets, refused)
            failures += watch.problems
            if watch.labels_at_updates[:-1] and version in watch.labels_at_updates[:-1]:
                failures.append(f"the version label became {version!r} before the last bucket had landed: "
                                f"set it with the last (empty) bucket, or after every bucket")
            if not isinstance(result, dict) or not {"buckets", "flush_tries"} <= set(result):
                failures.append(f"rl_sync returns a dict with at least 'buckets' and 'flush_tries', got {result!r}")
            else:
                if result["flush_tries"] != refused + 1:
                    failures.append(f"flush_tries should count the flush calls of the first flush: the server "
                                    f"refused {refused} and accepted the next, so {refused + 1}; you returned "
                                    f"{result['flush_tries']!r}")
                if result["buckets"] != n_buckets:
                    failures.append(f"'buckets' should be {n_buckets} (the non-empty buckets sent), "
                                    f"you returned {result['buckets']!r}")
            failures += [f"a generating client got an error: {e}" for e in errors[:2]]
            seen = {"default", version}
            for reply in replies:
                versions = [s["version"] for s in reply["meta_info"]["weight_versions"]]
                if not set(versions) <= seen or versions != sorted(versions, key=["default", version].index):
                    failures.append(f"a reply carries the version spans {versions}; only 'default' then "
                                    f"{version!r} are possible")
                    break
            if not failures:
                try:
                    server.worker.call_sync(lambda e: assert_hot_equals_cold(e, new_path, prompts[:2], cold=cold),
                                            timeout=60)
                    with EngineClient(server.url) as c:
                        served = c.generate(text=prompts[0], sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                                              "ignore_eos": True})
                        got_version = c.get_weight_version()["weight_version"]
                except (AssertionError, EngineError) as exc:
                    return [f"after rl_sync the server does not serve the new weights: {exc}"]
                want = cold.generate(prompts[0], {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
                if served["output_ids"] != want[0]["output_ids"]:
                    failures.append("a prompt served before the update gets a different answer than a cold start "
                                    "on the new weights: stale state survived")
                if got_version != version:
                    failures.append(f"GET /get_weight_version says {got_version!r}, expected {version!r}")
            if not failures and watch.steps["new"] == 0:
                failures.append("no request ran on the new weights after rl_sync (the test could not judge it)")
    return failures
