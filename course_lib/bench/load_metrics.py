"""What the serve-load benchmark computes from its records: pure functions, tested alone.

Clocks: every time here is ``time.monotonic()`` (CLOCK_MONOTONIC on Linux, one clock for
every process of the machine), taken by the load clients (when a request is sent, when an
event arrives) and by the trainer process (when it sent a pause, when the reply to its
continue_generation arrived).

A request record (``load_clients.RequestRecord``) keeps ``sent`` (the attempt the server
accepted), ``events`` (arrival time, tokens so far) and ``spans`` (the final event's
``weight_versions``: which version made each token). An update record (``load_processes``)
keeps ``version``, ``t_pause_sent`` and ``t_done`` (its continue_generation reply received).

Stale tokens (what the per-token versions prove, and nothing more). The versions are
ordered: the engine's first label, then the updates' labels in the order they were made.
A token is stale when its version is older than

(a) the newest update whose continue_generation reply had reached the trainer before the
    token's request was sent: that update was complete and live, so every step that could
    produce this request's tokens ran on it or on a later one (this holds in every pause
    mode: keep mode's frozen requests were sent before the update, so their tokens, made
    by the new weights over old KV, are not judged by it); or
(b) the version of an earlier token of the same request: weights never go back, so a
    token after a newer one made by older weights was made by weights already replaced.

The arrival time of a token is not used: a token made before an update may reach its
client after the update's reply, so "arrived after" proves nothing. A version label this
run never made counts as ``unknown`` (reported with the errors).

Stall of an update: the longest gap between two consecutive token arrivals, over all
clients merged into one timeline, that overlaps the update's window (from the trainer
sending the pause to it receiving the continue reply). It is what the busiest observer
sees: no client received any token for that long. None when no token arrived after the
window (nothing left to stall). A gap that began before the previous update's window
closed counts only from that close (an update that starts right after a long one is not
charged the long one's stall). ``stall_parts`` splits it into the time before the
window, inside it and after it, so a report can say what a stall is made of.
"""
from __future__ import annotations

import bisect
import math


def percentile(values, q: float) -> float | None:
    """The ``q``-th percentile (0..100) by linear interpolation; None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def token_versions(spans: list[dict]) -> list:
    """One version per token, from ``weight_versions`` spans."""
    out = []
    for s in spans:
        out.extend([s["version"]] * (s["end"] - s["start"]))
    return out


def version_order(initial: str, updates: list[dict]) -> dict:
    """Version label -> its place in time: the first label 0, then each update's label in
    the order the updates were made (a failed update's label too: it may have landed)."""
    order = {initial: 0}
    for k, u in enumerate(updates, 1):
        order.setdefault(u["version"], k)
    return order


def count_stale(records, updates: list[dict], initial: str) -> dict:
    """Stale tokens by the module docstring's definition: ``stale`` (with a few
    ``examples``), ``checked`` (tokens judged), ``unknown`` (labels this run never made)."""
    order = version_order(initial, updates)
    done = sorted((u["t_done"], order[u["version"]]) for u in updates if u.get("t_done") is not None)
    done_times = [t for t, _ in done]
    floor_after = [0]  # floor_after[i]: the newest version among the first i completed updates
    for _, v in done:
        floor_after.append(max(floor_after[-1], v))
    stale = checked = unknown = 0
    examples = []
    for rec in records:
        floor = floor_after[bisect.bisect_left(done_times, rec.sent)]  # completed strictly before sent
        newest = 0
        for i, label in enumerate(token_versions(rec.spans)):
            checked += 1
            v = order.get(label)
            if v is None:
                unknown += 1
                continue
            if v < floor or v < newest:
                stale += 1
                if len(examples) < 5:
                    examples.append({"request": rec.rid, "token": i, "version": label,
                                     "live_when_sent": floor, "earlier_token_version": newest})
            newest = max(newest, v)
    return {"stale": stale, "checked": checked, "unknown": unknown, "examples": examples}


def arrivals(records) -> list[float]:
    """Every token-carrying event's arrival time, all clients merged, sorted."""
    return sorted(t for rec in records for t, _ in rec.events)


def stall(times: list[float], start: float, end: float, since: float | None = None) -> float | None:
    """The longest gap between consecutive ``times`` (sorted) that overlaps [start, end];
    None when no time falls after ``end`` or none before ``start``. ``since`` (at most
    ``start``: the end of the previous update's window) clips where a gap may begin, so a
    gap that began during the previous update is charged to this one only from the moment
    that update was done (never the same stall twice)."""
    gap = longest_gap(times, start, end, since)
    return None if gap is None else gap[1] - gap[0]


def longest_gap(times: list[float], start: float, end: float,
                since: float | None = None) -> tuple[float, float] | None:
    """``stall``'s gap itself, as (its beginning: the last arrival before it, or ``since``
    if later; the first arrival after it)."""
    i = bisect.bisect_left(times, start)  # times[i - 1] < start <= times[i]
    j = bisect.bisect_right(times, end)   # times[j - 1] <= end < times[j]
    if i == 0 or j >= len(times):
        return None
    floor = float("-inf") if since is None else min(since, start)
    k = max(range(i - 1, j), key=lambda k: times[k + 1] - max(times[k], floor))
    return max(times[k], floor), times[k + 1]


def stall_parts(times: list[float], start: float, end: float, since: float | None = None) -> dict | None:
    """Where an update's stall lies against its window [start, end] (the pause sent, the
    continue replied): ``before_s``, how long before the pause was sent the last token
    came (the step in flight, or a quiet moment); ``inside_s``, the part of the window
    the gap covers; ``after_s``, how long after the continue reply the first token came
    (the first step on the new weights, a retried request's prefill). They add up to the
    stall. None where ``stall`` is None. ``since``: as for ``stall``."""
    gap = longest_gap(times, start, end, since)
    if gap is None:
        return None
    a, b = gap
    before, after = max(0.0, start - a), max(0.0, b - end)
    return {"before_s": before, "inside_s": (b - a) - before - after, "after_s": after}


def throughput(records, start: float, deadline: float) -> float:
    """Output tokens per second of requests that completed, counting the tokens that
    arrived between ``start`` and ``deadline``: the phase's last requests, finishing after
    it at a lower concurrency, would otherwise lower a short phase's figure more than a
    long one's. Tokens of requests aborted by a pause are work thrown away: not counted."""
    tokens = 0
    for rec in records:
        if rec.outcome == "completed":
            tokens += max((n for t, n in rec.events if start <= t <= deadline), default=0)
    return tokens / (deadline - start)


def latencies(records) -> dict:
    """Time to first token (from the first attempt, retries while paused included) and
    inter-token latency (each event's gap to the previous one, shared by its new tokens:
    one sample per token), over requests that completed, in seconds."""
    ttft, itl = [], []
    for rec in records:
        if rec.outcome != "completed" or not rec.events:
            continue
        ttft.append(rec.events[0][0] - rec.first_sent)
        for (t0, n0), (t1, n1) in zip(rec.events, rec.events[1:]):
            itl.extend([(t1 - t0) / (n1 - n0)] * (n1 - n0))
    return {"ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99)}
