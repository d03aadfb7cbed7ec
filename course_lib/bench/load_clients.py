"""The serve-load benchmark's clients: concurrent streaming /generate requests over httpx.

Each client sends one request at a time, back to back, over a connection of its own, of
seeded mixed prompt and output lengths, reads its server-sent events and keeps a
``RequestRecord``. A 503 ``paused``
(generation is paused for an update) is retried with a growing pause, as a client of an RL
rollout would; it is counted, not an error. Bounded: a phase ends at its deadline or when
its request budget is spent, and every wait has a timeout.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import random
import ssl
import time
from dataclasses import dataclass, field

import httpx

WORDS = ("weights", "update", "stream", "token", "engine", "trainer", "version", "pause", "batch", "kernel",
         "cache", "block", "graph", "prefill", "decode", "reward", "policy", "rollout", "step", "bucket")
PAUSED_RETRY_S = (0.02, 0.1)  # first and longest wait between retries of a paused /generate
PAUSED_GIVE_UP_S = 120.0      # a pause longer than this is an error, not an update
READ_TIMEOUT_S = 120.0


@dataclass
class RequestRecord:
    client: int
    first_sent: float                 # the first attempt (time to first token counts from here)
    sent: float = 0.0                 # the attempt the server accepted
    rid: str | None = None
    events: list = field(default_factory=list)  # (arrival time, tokens so far), one per event with new tokens
    spans: list = field(default_factory=list)   # the final event's weight_versions
    tokens: int = 0
    outcome: str = "error"            # completed / aborted_by_pause / error
    error: str | None = None
    paused_retries: int = 0
    end: float = 0.0


@dataclass
class Budget:
    """A phase's limits, shared by its clients: a deadline and a request count."""
    deadline: float
    max_requests: int
    sent: int = 0

    def take(self) -> bool:
        if time.monotonic() >= self.deadline or self.sent >= self.max_requests:
            return False
        self.sent += 1
        return True


def request_mix(seed: int, prompt_chars: tuple[int, int], output_tokens: tuple[int, int]):
    """An endless, seeded sequence of (prompt, max_new_tokens) of mixed lengths."""
    rng = random.Random(seed)
    while True:
        n = rng.randint(*prompt_chars)
        text = ""
        while len(text) < n:
            text += rng.choice(WORDS) + " "
        yield text[:n], rng.randint(*output_tokens)


def classify(final: dict) -> str:
    reason = final["meta_info"]["finish_reason"] or {}
    if reason.get("type") in ("length", "stop"):
        return "completed"
    if reason.get("type") == "abort" and "pause" in str(reason.get("message", "")):
        return "aborted_by_pause"
    return "error"


async def one_request(http: httpx.AsyncClient, client: int, prompt: str, max_new_tokens: int) -> RequestRecord:
    """Send one streaming request (retrying while paused) and record how it went."""
    body = {"text": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    rec = RequestRecord(client, time.monotonic())
    wait = PAUSED_RETRY_S[0]
    try:
        for _ in range(int(PAUSED_GIVE_UP_S / PAUSED_RETRY_S[0])):  # bounded; the clock below ends it sooner
            rec.sent = time.monotonic()
            async with http.stream("POST", "/generate", json=body) as reply:
                if reply.status_code == 503 and rec.sent - rec.first_sent < PAUSED_GIVE_UP_S:
                    err = json.loads(await reply.aread()).get("error", {})
                    if err.get("code") == "paused":
                        rec.paused_retries += 1
                        await asyncio.sleep(wait)
                        wait = min(2 * wait, PAUSED_RETRY_S[1])
                        continue
                if reply.status_code != 200:
                    rec.error = f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}"
                    return rec
                await read_events(reply, rec)
                return rec
        rec.error = "still paused after every retry"
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        rec.error = (f"{type(exc).__name__}: {exc} (after {len(rec.events)} token events, "
                     f"{rec.paused_retries} paused retries, {time.monotonic() - rec.first_sent:.3f} s)")
    finally:
        rec.end = time.monotonic()
    return rec


async def read_events(reply: httpx.Response, rec: RequestRecord) -> None:
    """Read the event stream into ``rec``; anything malformed is a stream error."""
    final, done, seen = None, False, 0
    async for line in reply.aiter_lines():
        if not line:
            continue
        if not line.startswith("data: ") or done:
            rec.error = f"stream error: unexpected line {line[:100]!r}"
            return
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        event = json.loads(data)
        if "error" in event:
            rec.error = f"stream error: {event['error']}"
            continue
        meta = event["meta_info"]
        n = meta["completion_tokens"]
        if n > seen:
            rec.events.append((time.monotonic(), n))
            seen = n
        rec.rid = meta["id"]
        if meta["finish_reason"] is not None:
            final = event
    if rec.error:
        return
    if not done or final is None:
        rec.error = "stream error: ended without " + ("[DONE]" if final else "a final event")
        return
    rec.spans, rec.tokens = final["meta_info"]["weight_versions"], len(final["output_ids"])
    if sum(s["end"] - s["start"] for s in rec.spans) != rec.tokens:
        rec.error = "stream error: the version spans do not cover the output"
        return
    rec.outcome = classify(final)
    if rec.outcome == "error":
        rec.error = f"finished with {final['meta_info']['finish_reason']}"


async def client_loop(http, client: int, mix, budget: Budget, records: list) -> None:
    while budget.take():
        prompt, max_new_tokens = next(mix)
        records.append(await one_request(http, client, prompt, max_new_tokens))


# One TLS context for every client: httpx builds one per client otherwise (20 ms each of
# reading the CA bundle), though these clients speak plain HTTP.
_TLS = ssl.create_default_context()


def connection(url: str) -> httpx.AsyncClient:
    """One client's own HTTP client, holding at most one connection. Not one pool shared by
    every client: httpcore's pool walks all its connections whenever a request starts or
    ends (with a poll() of each idle socket), so with 64 clients the load generator spent a
    third of its time there and its requests left late (the time to first token it measured
    was its own: p99 2.9 s on a 2-core CPU, 0.15 s with a connection per client)."""
    # An idle connection is dropped here after 2 s, before the server's keep-alive timeout
    # (uvicorn's 5 s) can close it under a request just being sent on it.
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=2.0)
    return httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(READ_TIMEOUT_S, connect=30.0),
                             verify=_TLS)


async def run_phase(url: str, clients: int, seconds: float, max_requests: int, seed: int,
                    prompt_chars, output_tokens, tick=None,
                    probe=None) -> tuple[list[RequestRecord], float, float, float]:
    """``clients`` clients for ``seconds`` (then their last requests finish); returns the
    records, the phase's start, its deadline (no request sent after it) and its end. ``tick(records)`` is called about twice a
    second while it runs (progress, the trainer's messages). ``probe`` (``load_trace.ClientProbe``)
    watches this process's collections and event loop while the phase runs."""
    records: list[RequestRecord] = []
    if probe is not None:
        probe.start(asyncio.get_running_loop())
    start = time.monotonic()
    budget = Budget(start + seconds, max_requests)
    try:
        async with contextlib.AsyncExitStack() as stack:
            https = [await stack.enter_async_context(connection(url)) for _ in range(clients)]
            tasks = [asyncio.create_task(client_loop(https[c], c, request_mix(seed * 1000 + c, prompt_chars,
                                                                              output_tokens), budget, records))
                     for c in range(clients)]
            while not all(t.done() for t in tasks):
                await asyncio.wait(tasks, timeout=0.5)
                # The records grow by a tuple per token event, and a full collection walks
                # every one: 0.3 s with ~100k events on a CPU, during which no client reads
                # anything and every stream seems to stall. They live to the end of the run
                # anyway: frozen, the collector never walks them again.
                gc.freeze()
                if tick is not None:
                    tick(records)
            for t in tasks:
                t.result()  # a bug in a client shows here
        end = time.monotonic()
    finally:
        gc.unfreeze()  # the phase is over: this process's objects are the collector's again
        if probe is not None:
            probe.stop()
    return records, start, budget.deadline, end
