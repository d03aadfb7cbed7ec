"""The serve-load benchmark: a few seconds of real load (a server process, streaming clients,
a trainer process updating the weights) holds its invariants; and its counters count:
fabricated records with stale tokens, or a stall, are caught."""
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from course_lib.bench import load_metrics as m  # noqa: E402
from course_lib.bench import serve_load  # noqa: E402
from course_lib.bench.load_clients import RequestRecord  # noqa: E402
from course_lib.bench.load_processes import TRANSPORTS  # noqa: E402


def record(sent: float, spans: list[tuple[str, int]], rid: str = "r") -> RequestRecord:
    """A finished request sent at ``sent`` whose tokens came in runs (version, count)."""
    rec = RequestRecord(client=0, first_sent=sent, sent=sent, rid=rid, outcome="completed")
    start = 0
    for version, n in spans:
        rec.spans.append({"version": version, "start": start, "end": start + n})
        start += n
    rec.tokens = start
    rec.events = [(sent + 0.01 * (i + 1), i + 1) for i in range(start)]
    return rec


# Two updates: u1 live (continue replied) at t=10, u2 at t=20.
UPDATES = [{"version": "u1", "t_pause_sent": 9.0, "t_done": 10.0}, {"version": "u2", "t_pause_sent": 19.0,
                                                                    "t_done": 20.0}]


def test_tokens_of_requests_sent_after_an_update_must_carry_it():
    fresh = [record(5.0, [("default", 3), ("u1", 2)]),   # in flight across u1 (keep / retract): fine
             record(10.5, [("u1", 4)]),                    # sent once u1 was live: fine
             record(19.5, [("u1", 2), ("u2", 2)]),         # sent while u2 was under way: fine
             record(25.0, [("u2", 3)])]
    assert m.count_stale(fresh, UPDATES, "default")["stale"] == 0
    stale = m.count_stale(fresh + [record(10.5, [("default", 2), ("u1", 1)], rid="old")], UPDATES, "default")
    assert stale["stale"] == 2 and stale["checked"] == 16 + 3
    assert stale["examples"][0] == {"request": "old", "token": 0, "version": "default", "live_when_sent": 1,
                                    "earlier_token_version": 0}
    # Sent after u2 was live, yet made by u1: stale, even though u1 is newer than the start.
    assert m.count_stale([record(21.0, [("u1", 1), ("u2", 1)])], UPDATES, "default")["stale"] == 1


def test_a_version_going_back_within_a_request_is_stale():
    rec = record(5.0, [("default", 2), ("u1", 2), ("default", 1), ("u2", 1)])
    assert m.count_stale([rec], UPDATES, "default")["stale"] == 1
    assert m.count_stale([record(5.0, [("nobody-made-this", 2)])], UPDATES, "default")["unknown"] == 2


def test_stall_is_the_longest_merged_gap_overlapping_the_window():
    times = [0.0, 0.1, 0.2, 1.5, 1.6, 3.0, 3.1]
    assert m.stall(times, 1.0, 1.2) == pytest.approx(1.3)   # the gap 0.2 -> 1.5 holds the window
    assert m.stall(times, 1.55, 2.0) == pytest.approx(1.4)  # 1.6 -> 3.0
    assert m.stall(times, 0.05, 1.55) == pytest.approx(1.3)
    assert m.stall(times, 3.2, 4.0) is None                 # nothing arrived after it
    assert m.percentile([1, 2, 3, 4], 50) == 2.5 and m.percentile([], 50) is None


def test_a_stall_splits_into_before_inside_and_after_its_window():
    times = [0.0, 0.1, 0.2, 1.5, 1.6, 3.0, 3.1]
    parts = m.stall_parts(times, 1.0, 1.2)  # the gap 0.2 -> 1.5
    assert parts == pytest.approx({"before_s": 0.8, "inside_s": 0.2, "after_s": 0.3})
    assert m.stall_parts(times, 0.15, 1.55) == pytest.approx({"before_s": 0.0, "inside_s": 1.3, "after_s": 0.0})
    assert sum(m.stall_parts(times, 1.55, 2.0).values()) == pytest.approx(m.stall(times, 1.55, 2.0))
    assert m.stall_parts(times, 3.2, 4.0) is None


def test_a_stall_that_began_in_the_previous_update_counts_from_its_end():
    times = [0.0, 0.1, 3.0, 3.1]  # no token from 0.1 to 3.0: update 1 ran 0.5 -> 2.5, update 2 2.6 -> 2.8
    assert m.stall(times, 0.5, 2.5) == pytest.approx(2.9)
    assert m.stall(times, 2.6, 2.8) == pytest.approx(2.9)               # unclipped: charged twice
    assert m.stall(times, 2.6, 2.8, since=2.5) == pytest.approx(0.5)    # from update 1's end to the next token
    assert m.stall_parts(times, 2.6, 2.8, since=2.5) == pytest.approx({"before_s": 0.1, "inside_s": 0.2,
                                                                       "after_s": 0.2})
    assert m.stall([0.0, 2.7, 3.0], 2.6, 2.8, since=2.5) == pytest.approx(0.3)  # a later gap can be the longest


def test_the_stall_goal_is_the_p99_of_stall_over_own_time_per_transport():
    def upd(transport, own, stall):
        return {"transport": transport, "own_ms": own, "stall_ms": stall, "stall_over_own": stall / own,
                "stall_over_whole": stall / (2 * own),
                **{k: 1.0 for k in ("stall_before_ms", "pause_ms", "flush_ms", "update_wall_ms", "continue_ms",
                                    "stall_after_ms")}}
    goal = serve_load.stall_goal([upd("disk", 100, 150)] * 3 + [upd("registered", 10, 50)])
    assert goal["disk"]["p99_stall_over_own"] == pytest.approx(1.5) and goal["disk"]["updates"] == 3
    assert goal["registered"]["p99_stall_over_own"] == pytest.approx(5.0)
    assert goal["registered"]["p99_stall_over_whole"] == pytest.approx(2.5)
    assert goal["all"]["p99_stall_over_own"] > 4.8 and goal["all"]["median_own_ms"] == 100


def test_throughput_counts_completed_tokens_that_arrived_within_the_phase():
    done = record(0.0, [("default", 10)])             # events at 0.01 .. 0.10
    aborted = record(0.0, [("default", 10)], rid="a")
    aborted.outcome = "aborted_by_pause"
    assert m.throughput([done, aborted], 0.0, 0.05) == pytest.approx(5 / 0.05)


def test_a_few_seconds_of_load_through_updates_hold(capsys):
    """4 clients, 3 updates (one per transport; pause modes abort, wait, keep)."""
    res = serve_load.main(["--preset", "tiny", "--clients", "4", "--duration-s", "3.5", "--baseline-s", "1.5",
                           "--update-every-s", "1.0", "--bucket-mb", "0.1", "--output-tokens", "8", "40",
                           "--prompt-chars", "8", "80"])
    print(capsys.readouterr().out)
    assert res["errors"] == 0, (res["baseline"]["error_examples"], res["with_updates"]["error_examples"],
                                [u["error"] for u in res["updates"]], res["trainer_failure"])
    assert res["stale_tokens"] == 0 and res["tokens_checked"] > 100, res["stale_examples"]
    assert res["hot_equals_cold"] is True and res["served_version"] == "u3"
    assert [u["transport"] for u in res["updates"]] == list(TRANSPORTS)
    assert [u["mode"] for u in res["updates"]] == ["abort", "wait", "keep"]
    assert all(u["error"] is None and u["own_ms"] > 0 and u["messages"] >= 1 for u in res["updates"])
    for u in res["updates"]:  # the window's parts, as the trainer timed them, add up to the whole
        parts = [u[k] for k in ("pause_ms", "flush_ms", "update_wall_ms", "continue_ms")]
        assert all(p >= 0 for p in parts) and sum(parts) == pytest.approx(u["total_ms"], rel=1e-6)
    assert res["stall_goal"]["all"]["updates"] == 3
    assert res["with_updates"]["completed"] > 0 and res["baseline"]["completed"] > 0
    assert res["throughput_ratio"] > 0


def test_a_traced_baseline_explains_its_gaps_and_first_tokens(capsys):
    """--baseline-only --trace: one phase, no trainer; every completed request's first token
    split at its prefill step, the longest gaps each charged to something."""
    res = serve_load.main(["--preset", "tiny", "--clients", "4", "--baseline-only", "--trace", "--baseline-s", "2",
                           "--output-tokens", "8", "24", "--prompt-chars", "8", "60"])
    out = capsys.readouterr().out
    assert res["errors"] == 0 and res["hot_equals_cold"] is True
    assert res["with_updates"] is None and res["updates"] == [] and res["baseline"]["completed"] > 0
    ex = res["baseline"]["explained"]
    assert ex["first_tokens_traced"] == res["baseline"]["completed"]
    assert len(ex["gaps"]) == 5 and all(0 < g["largest"]["seconds"] <= g["seconds"] + 1e-9 for g in ex["gaps"])
    assert ex["gaps"][0]["seconds"] == pytest.approx(res["baseline"]["merged_gap_max_s"])
    steps = res["trace"]["baseline"]["server"]["steps"]
    assert {"prefill", "decode"} <= {s["kind"] for s in steps}
    assert "the longest gaps with no token for any client" in out and "time to first token p50 / p99" in out
