"""The serving trace and what the serve-load benchmark explains with it: a traced server
records its steps, collections and event-loop lateness on the clients' clock and leaves
nothing behind when detached; a gap is charged to what covered it (a compile, a client's
collection, a long step), and a first token's time splits at its prefill step."""
import gc
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from course_lib import Engine  # noqa: E402
from course_lib.bench import load_trace as lt  # noqa: E402
from course_lib.bench.load_clients import RequestRecord  # noqa: E402
from course_lib.server.runner import BackgroundServer  # noqa: E402
from course_lib.server.step_trace import CompileLog, StepTrace  # noqa: E402

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def step(t0, t1, kind="decode", seqs=8, tokens=8, graph=True, rids=()):
    rec = {"t0": t0, "t1": t1, "kind": kind, "seqs": seqs, "tokens": tokens, "graph": graph, "waiting": 0,
           "running": seqs, "commands": 0, "commands_s": 0.0}
    if kind == "prefill":
        rec["rids"] = list(rids)
    return rec


def trace(steps, compiles=(), gcs=(), late=()):
    return {"steps": list(steps), "compiles": list(compiles), "gc": list(gcs), "gc_counts": [0, 0, len(gcs)],
            "loop_late": list(late), "loop_samples": 100, "compile_hooks": True}


def test_a_traced_server_records_its_steps_collections_and_loop(make_ckpt):
    engine = Engine(make_ckpt("tiny", seed=91))
    srv = BackgroundServer(engine)
    tracer = StepTrace().attach(srv.worker)
    with srv:
        t0 = time.monotonic()
        outs = httpx.post(f"{srv.url}/generate", json={"text": ["traced", "twice"], "sampling_params": GREEDY},
                          timeout=60).json()
        srv.worker.call_sync(lambda e: gc.collect())  # a full collection on the engine thread
        time.sleep(0.05)  # the loop probe posts every 5 ms
        snap = tracer.snapshot(t0, time.monotonic())
    tracer.detach()
    kinds = [s["kind"] for s in snap["steps"]]
    assert "prefill" in kinds and kinds.count("decode") >= 5, kinds
    prefill = next(s for s in snap["steps"] if s["kind"] == "prefill")
    assert sorted(prefill["rids"]) == sorted(o["meta_info"]["id"] for o in outs)
    assert prefill["seqs"] == 2 and prefill["tokens"] == sum(o["meta_info"]["prompt_tokens"] for o in outs)
    assert prefill["graph"] is False  # a CPU engine captures no graph
    assert all(t0 <= s["t0"] <= s["t1"] for s in snap["steps"])
    assert any(g["generation"] == 2 and g["thread"] == "engine-loop" for g in snap["gc"]), snap["gc"]
    assert snap["loop_samples"] > 0
    # Detached: the worker runs its class's own methods again, and the collector calls nobody.
    assert not {"_step", "_run", "_push_progress", "submit"} & set(srv.worker.__dict__)
    assert tracer.gc._callback not in gc.callbacks


def test_a_compile_hook_call_is_recorded_with_its_unaligned_pointers():
    log = CompileLog()
    # What Triton 3.4-3.6 pass their JIT hooks: the signature by name, the attributes by path.
    kw = {"key": "k", "fn": type("Info", (), {"name": "_paged_prefill_kernel"})(),
          "compile": {"signature": {"q_ptr": "*bf16", "ctx_ptr": "*i64", "starts_ptr": "*i64", "scale": "fp32"},
                      "configs": [{(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}]}}
    assert log._pre(**kw) is None  # falsy: Triton goes on and compiles
    log._post(**kw)
    (rec,) = log.records
    assert rec["kernel"] == "_paged_prefill_kernel" and rec["unaligned"] == ["ctx_ptr"] and rec["t1"] >= rec["t0"]


def test_a_gap_is_charged_to_what_covered_it():
    steps = [step(0.0, 0.01), step(0.01, 0.02), step(0.02, 0.75, kind="prefill", seqs=37, tokens=3517, graph=False),
             step(0.75, 0.76)]
    compile_ = {"t0": 0.03, "t1": 0.74, "kernel": "_paged_prefill_kernel", "unaligned": ["ctx_ptr"],
                "thread": "engine-loop"}
    g = lt.explain_gap(0.02, 0.76, trace(steps, compiles=[compile_]), None)
    assert g["largest"]["what"].startswith("Triton compile of _paged_prefill_kernel")
    assert g["largest"]["seconds"] == pytest.approx(0.71)
    # Without the compile, the eager prefill step is what covered it.
    g = lt.explain_gap(0.02, 0.76, trace(steps), None)
    assert g["largest"]["what"].startswith("a prefill step (37 sequences, 3517 tokens, eager)")
    # The clients' own collection covering a gap while the engine kept stepping.
    busy = [step(0.01 * i, 0.01 * (i + 1)) for i in range(100)]
    client = {"gc": [{"t0": 0.2, "t1": 0.55, "generation": 2, "collected": 0, "thread": "MainThread"}],
              "loop_late": [], "gc_counts": [0, 0, 1], "loop_samples": 10}
    g = lt.explain_gap(0.19, 0.56, trace(busy), client)
    assert g["largest"]["what"].startswith("clients' garbage collection, generation 2")
    assert g["engine_busy_s"] == pytest.approx(0.37)


def test_a_gap_filled_by_commands_is_charged_to_them():
    after = step(0.55, 0.56)
    after.update(commands=2, commands_s=0.5, commands_t0=0.05, slowest_command="update_weights", slowest_command_s=0.49)
    g = lt.explain_gap(0.04, 0.56, trace([step(0.03, 0.04), after]), None)
    assert g["largest"]["what"] == "2 commands on the engine thread (the slowest: update_weights)"
    assert g["largest"]["seconds"] == pytest.approx(0.5) and g["engine_busy_s"] == pytest.approx(0.51)


def test_longest_gaps_are_sorted_longest_first():
    assert lt.longest_gaps([0.0, 0.1, 0.5, 0.6, 1.6], top=2) == [(0.6, 1.6), (0.1, 0.5)]


def test_a_first_token_splits_at_its_prefill_step():
    rec = RequestRecord(client=0, first_sent=1.0, sent=1.0, rid="r1", outcome="completed", events=[(1.5, 1)])
    other = RequestRecord(client=1, first_sent=1.0, sent=1.0, rid="r2", outcome="completed", events=[(1.2, 1)])
    steps = [step(1.05, 1.1, kind="prefill", seqs=1, tokens=40, rids=["r2"]), step(1.1, 1.2),
             step(1.3, 1.45, kind="prefill", seqs=1, tokens=90, rids=["r1"])]
    parts = {p["rid"]: p for p in lt.first_token_parts([rec, other], steps)}
    p = parts["r1"]
    assert p["ttft_s"] == pytest.approx(0.5) and p["queued_s"] == pytest.approx(0.3)
    assert p["prefill_s"] == pytest.approx(0.15) and p["delivered_s"] == pytest.approx(0.05)
    assert p["prefills_ahead"] == 1  # r2's prefill ran while r1 waited
    assert parts["r2"]["prefills_ahead"] == 0
    ex = lt.explain([rec, other], [1.2, 1.5], trace(steps), None)
    assert ex["first_tokens_traced"] == 2 and ex["slowest_first_tokens"][0]["rid"] == "r1"
    assert ex["steps_by_kind"]["prefill graph"]["steps"] == 2 and ex["steps_by_kind"]["decode graph"]["steps"] == 1


def test_the_clients_work_per_request_does_not_grow_with_their_number(make_ckpt, monkeypatch):
    """Each load client has a connection of its own. One pool shared by 64 clients walked
    every connection whenever a request started or ended, and the load generator's own
    delays became the time to first token it reported (see ``load_clients.connection``)."""
    import asyncio

    import httpcore

    from course_lib.bench.load_clients import run_phase

    checks = []
    is_idle = httpcore.AsyncHTTPConnection.is_idle
    monkeypatch.setattr(httpcore.AsyncHTTPConnection, "is_idle", lambda self: checks.append(1) or is_idle(self))
    with BackgroundServer(Engine(make_ckpt("tiny", seed=92))) as srv:
        records, *_ = asyncio.run(run_phase(srv.url, 16, 1.0, 10_000, 0, (8, 40), (2, 6)))
    done = [r for r in records if r.outcome == "completed"]
    assert len(done) >= 16, [r.error for r in records][:3]
    # A pool's bookkeeping looks at each of its connections once or twice per request; with
    # one pool for all 16 clients it looked at 16 connections a few times per request.
    assert len(checks) / len(records) <= 8, f"{len(checks) / len(records):.1f} connection checks per request"
