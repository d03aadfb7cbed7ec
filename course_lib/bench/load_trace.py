"""The serve-load benchmark's explanations: what happened while no client got a token, and
where a slow first token spent its time. Pure functions of the records and the traces.

Inputs, all on ``time.monotonic()`` (one clock for every process of the machine): the
token arrivals of the load clients (``load_metrics.arrivals``); the server's trace
(``server/step_trace.py``'s ``snapshot``: engine steps, collections, Triton compiles,
event-loop lateness); the clients' own (``ClientProbe``: collections and lateness of
their event loop).

A gap is the time between two consecutive arrivals, all clients merged. For each of the
longest, ``explain_gap`` lists what overlapped it and names the largest of those, by its
overlap with the gap: a compile, a collection (server or clients), a late event loop
(server or clients), the longest engine step, or the engine thread idle. The largest
overlap is what the trace saw, not a proof of cause: a reader checks that it covers the
gap (``largest.seconds`` close to ``seconds``).

A first token's time (sent to first arrival) splits at the prefill step that admitted its
request (found by request id): ``queued_s`` (HTTP, the command queue, steps ahead of it),
``prefill_s`` (that step) and ``delivered_s`` (hand-over to the event loop, the reply's
trip, the client reading it).
"""
from __future__ import annotations

import bisect

from course_lib.bench.load_metrics import percentile
from course_lib.server.step_trace import GcLog, LoopProbe

TOP_GAPS = 5
TOP_FIRST_TOKENS = 10


class ClientProbe:
    """The load clients' own pauses: their collections and their event loop's lateness."""

    def __init__(self):
        self.gc, self.loop = GcLog(), LoopProbe()

    def start(self, loop) -> "ClientProbe":
        self.gc.install()
        self.loop.start(loop)
        return self

    def stop(self) -> None:
        self.gc.remove()
        self.loop.stop()

    def snapshot(self, start: float, end: float) -> dict:
        def within(records):
            return [dict(r) for r in list(records) if r["t1"] >= start and r["t0"] <= end]
        return {"gc": within(self.gc.records), "gc_counts": list(self.gc.counts),
                "loop_late": within(self.loop.records), "loop_samples": self.loop.samples}


def overlap(r: dict, a: float, b: float) -> float:
    return max(0.0, min(r["t1"], b) - max(r["t0"], a))


def brief_step(r: dict | None) -> dict | None:
    """A step record without its request ids, its duration added."""
    if r is None:
        return None
    return {**{k: v for k, v in r.items() if k != "rids"}, "seconds": r["t1"] - r["t0"]}


def describe_step(r: dict) -> str:
    if r["kind"] == "none":
        return f"an engine pass with no step ({r['commands']} commands)"
    how = "CUDA graph" if r.get("graph") else "eager"
    return f"a {r['kind']} step ({r['seqs']} sequences, {r['tokens']} tokens, {how})"


def explain_gap(a: float, b: float, server: dict, client: dict | None) -> dict:
    """What overlapped the gap [a, b] (see the module docstring)."""
    steps = [r for r in server["steps"] if overlap(r, a, b) > 0]
    busy = sum(overlap(r, a, b) for r in steps)
    candidates = []
    for c in server["compiles"]:
        if overlap(c, a, b) > 0:
            candidates.append((overlap(c, a, b), f"Triton compile of {c['kernel']} (unaligned pointers: "
                                                 f"{c.get('unaligned')}) on thread {c['thread']}"))
    for who, trace in (("server", server), ("clients", client or {})):
        for g in trace.get("gc", []):
            if overlap(g, a, b) > 0:
                candidates.append((overlap(g, a, b), f"{who}' garbage collection, generation {g['generation']} "
                                                     f"({g['collected']} freed) on thread {g['thread']}"))
        late = [r for r in trace.get("loop_late", []) if overlap(r, a, b) > 0]
        if late:
            worst = max(late, key=lambda r: overlap(r, a, b))
            candidates.append((overlap(worst, a, b), f"{who}' event loop late by {worst['t1'] - worst['t0']:.3f} s"))
    commands = [{**r, "t0": r["commands_t0"], "t1": r["commands_t0"] + r["commands_s"]}
                for r in server["steps"] if r.get("commands_t0") is not None]
    busy += sum(overlap(r, a, b) for r in commands)  # commands run between steps, never during one
    slowest = max(commands, key=lambda r: overlap(r, a, b), default=None)
    if slowest is not None and overlap(slowest, a, b) > 0:
        name = slowest.get("slowest_command", "short ones")
        candidates.append((overlap(slowest, a, b), f"{slowest['commands']} commands on the engine thread "
                                                   f"(the slowest: {name})"))
    longest = max(steps, key=lambda r: overlap(r, a, b), default=None)
    if longest is not None:
        # A compile or a collection inside the step is named above on its own: the step is
        # charged only with the rest of its time.
        lo, hi = max(longest["t0"], a), min(longest["t1"], b)
        inside = sum(overlap(r, lo, hi) for r in server["compiles"] + server["gc"])
        candidates.append((overlap(longest, a, b) - inside,
                           describe_step(longest) + f" took {longest['t1'] - longest['t0']:.3f} s"))
    candidates.append(((b - a) - busy, "no engine pass (the engine thread waited: for work that had not reached "
                                       "it, or for the GIL)"))
    seconds, what = max(candidates)
    return {"start": a, "end": b, "seconds": b - a, "engine_passes": len(steps), "engine_busy_s": busy,
            "longest_step": brief_step(longest), "largest": {"what": what, "seconds": seconds},
            "overlapping": [{"what": w, "seconds": s} for s, w in sorted(candidates, reverse=True)[:6]]}


def longest_gaps(times: list[float], top: int = TOP_GAPS) -> list[tuple[float, float]]:
    """The ``top`` longest gaps between consecutive sorted ``times``, longest first."""
    gaps = sorted(zip(times, times[1:]), key=lambda g: g[1] - g[0], reverse=True)
    return gaps[:top]


def first_token_parts(records, steps: list[dict]) -> list[dict]:
    """Each completed request's time to first token split at its prefill step (see the
    module docstring); requests whose prefill the trace does not hold are left out."""
    prefills = sorted((r for r in steps if r["kind"] == "prefill"), key=lambda r: r["t0"])
    starts = [r["t0"] for r in prefills]
    by_rid: dict[str, list[dict]] = {}
    for r in prefills:
        for rid in r.get("rids", ()):
            by_rid.setdefault(rid, []).append(r)
    out = []
    for rec in records:
        if rec.outcome != "completed" or not rec.events:
            continue
        step = next((r for r in by_rid.get(rec.rid, []) if r["t0"] >= rec.first_sent), None)
        if step is None:
            continue
        first = rec.events[0][0]
        ahead = prefills[bisect.bisect_left(starts, rec.first_sent):bisect.bisect_left(starts, step["t0"])]
        out.append({"rid": rec.rid, "sent": rec.first_sent, "ttft_s": first - rec.first_sent,
                    "queued_s": step["t0"] - rec.first_sent, "prefill_s": step["t1"] - step["t0"],
                    "delivered_s": first - step["t1"], "prefills_ahead": len(ahead),
                    "prefill": brief_step(step)})
    return out


def explain(records, times: list[float], server: dict, client: dict | None) -> dict:
    """A phase's explanations: the longest gaps, what first tokens are made of (p50 / p99
    of each part), the slowest first tokens, and the trace's totals."""
    parts = first_token_parts(records, server["steps"])
    slowest = sorted(parts, key=lambda p: p["ttft_s"], reverse=True)[:TOP_FIRST_TOKENS]
    for p in slowest:
        p["during"] = explain_gap(p["sent"], p["sent"] + p["ttft_s"], server, client)["overlapping"][:3]
    steps = server["steps"]
    kinds = {}
    for r in steps:
        key = f"{r['kind']}{'' if r['kind'] == 'none' else (' graph' if r.get('graph') else ' eager')}"
        k = kinds.setdefault(key, {"steps": 0, "seconds": 0.0, "max_s": 0.0})
        k["steps"] += 1
        k["seconds"] += r["t1"] - r["t0"]
        k["max_s"] = max(k["max_s"], r["t1"] - r["t0"])
    return {
        "gaps": [explain_gap(a, b, server, client) for a, b in longest_gaps(times)],
        "first_token_parts": {f"{k}_{q}": percentile([p[k] for p in parts], int(q[1:]))
                              for k in ("ttft_s", "queued_s", "prefill_s", "delivered_s") for q in ("p50", "p99")},
        "first_tokens_traced": len(parts),
        "slowest_first_tokens": slowest,
        "steps_by_kind": kinds,
        "compiles": server["compiles"],
        "server_gc": {"counts": server.get("gc_counts"), "recorded": len(server["gc"]),
                      "max_s": max((g["t1"] - g["t0"] for g in server["gc"]), default=0.0)},
        "client_gc": None if client is None else {
            "counts": client.get("gc_counts"), "recorded": len(client["gc"]),
            "max_s": max((g["t1"] - g["t0"] for g in client["gc"]), default=0.0)},
        "server_loop_late_max_s": max((r["t1"] - r["t0"] for r in server["loop_late"]), default=0.0),
        "client_loop_late_max_s": None if client is None else max(
            (r["t1"] - r["t0"] for r in client["loop_late"]), default=0.0),
    }


def report_lines(name: str, ex: dict) -> list[str]:
    """The explanation in a few lines for the benchmark's printout."""
    ms = lambda s: "-" if s is None else f"{1e3 * s:.1f}"  # noqa: E731
    lines = [f"{name}: the longest gaps with no token for any client, and the largest thing that overlapped each"]
    for g in ex["gaps"]:
        lines.append(f"  {ms(g['seconds']):>8} ms: {g['largest']['what']} ({ms(g['largest']['seconds'])} ms of it; "
                     f"{g['engine_passes']} engine passes, busy {ms(g['engine_busy_s'])} ms)")
    f = ex["first_token_parts"]
    lines.append(f"{name}: time to first token p50 / p99 (ms) {ms(f['ttft_s_p50'])} / {ms(f['ttft_s_p99'])}: queued "
                 f"{ms(f['queued_s_p50'])} / {ms(f['queued_s_p99'])}, prefill {ms(f['prefill_s_p50'])} / "
                 f"{ms(f['prefill_s_p99'])}, delivered {ms(f['delivered_s_p50'])} / {ms(f['delivered_s_p99'])} "
                 f"({ex['first_tokens_traced']} requests traced)")
    for p in ex["slowest_first_tokens"][:3]:
        lines.append(f"  slowest: {ms(p['ttft_s'])} ms = queued {ms(p['queued_s'])} + prefill {ms(p['prefill_s'])} + "
                     f"delivered {ms(p['delivered_s'])}, {p['prefills_ahead']} prefills ahead; during it: "
                     + "; ".join(d["what"] for d in p["during"][:2]))
    kinds = ", ".join(f"{k}: {v['steps']} (max {ms(v['max_s'])} ms)" for k, v in ex["steps_by_kind"].items())
    lines.append(f"{name}: engine steps {kinds}; Triton compiles {len(ex['compiles'])} "
                 f"({ms(sum(c['t1'] - c['t0'] for c in ex['compiles']))} ms); longest collection server "
                 f"{ms(ex['server_gc']['max_s'])} ms, clients {ms((ex['client_gc'] or {}).get('max_s'))} ms; "
                 f"event loop late at most: server {ms(ex['server_loop_late_max_s'])} ms, clients "
                 f"{ms(ex['client_loop_late_max_s'])} ms")
    return lines
