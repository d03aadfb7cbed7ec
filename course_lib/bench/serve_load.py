"""Serving under load while a trainer changes the weights: does it hold?

    python -m course_lib.bench serve-load --preset tiny --clients 8 --duration-s 30 --json out.json

A real server process on 127.0.0.1 (weight routes on) serves ``--clients`` concurrent
streaming clients (seeded mixed prompt and output lengths, one request after another).
Two phases on the same server: a baseline with no update, then the same load while a
trainer process updates the weights every ``--update-every-s`` seconds, cycling through
the transports (registered buffers, a flattened tensor bucket, disk) and the pause modes
(abort, wait, keep, retract), each update pause -> flush -> update -> continue over HTTP
(``load_processes.py``). Checkpoints come from seeds; nothing is downloaded. Each phase
ends at its deadline or its request budget; the trainer stops with the loaded phase.

Reported: requests completed, aborted by a pause (expected in abort mode, counted apart)
and failed (HTTP errors, stream errors, unknown version labels, failed updates); output
tokens per second (``load_metrics.throughput``); p50 / p99 time to first token and
inter-token latency; per update, its transport, pause mode, own time (the engine's
``elapsed_ms`` summed over the update route's replies), its whole time (pause sent to
continue replied) and its stall; stale tokens; hot == cold at the end (the served greedy
outputs for fixed prompts, whole and streamed, equal those of a cold engine started on
the last checkpoint applied, and the served version is the last update's). Stall and
stale tokens are defined in ``load_metrics.py``. Ratios against the baseline of the same
run: throughput with updates / without, and each update's stall / its own time, with the
p99 of that ratio (the serving goal: at most 2) and the medians of the stall's parts per
transport (``stall_goal``).

``--baseline-only``: the same server and load without the trainer, one phase (what a
stream looks like with nothing in its way). ``--trace``: the server records what its
engine thread did and what else stopped it (``server/step_trace.py``), the clients what
stopped them, and each phase's longest gaps and slowest first tokens are explained from
those records (``load_trace.py``); the JSON holds the explanations and the trace.
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import httpx
import torch
from tqdm import tqdm

from course_lib.bench import run_header, save_json
from course_lib.bench.load_clients import run_phase
from course_lib.bench.load_metrics import arrivals, count_stale, latencies, percentile, stall_parts, throughput
from course_lib.bench.load_processes import ServerProcess, TrainerProcess
from course_lib.bench.load_trace import ClientProbe, explain, report_lines
from course_lib.config import is_cuda
from course_lib.weights.checkpoint import make_random

CHECK_PROMPTS = ["the served weights", "equal a cold start", "after every update", "of the run"]
CHECK_PARAMS = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
INITIAL_VERSION = "default"  # an engine's label before any update


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m course_lib.bench serve-load", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny", help="tiny (CPU) ... qwen3-8b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--clients", type=int, default=8, help="concurrent streaming clients, 1 to 64")
    p.add_argument("--duration-s", type=float, default=30.0, help="the phase with updates")
    p.add_argument("--baseline-s", type=float, default=None, help="the phase without (default: half of "
                                                                   "--duration-s, 2 to 60 s)")
    p.add_argument("--warmup-s", type=float, default=1.0, help="the same load first, not measured")
    p.add_argument("--update-every-s", type=float, default=3.0)
    p.add_argument("--max-requests", type=int, default=20_000, help="per phase")
    p.add_argument("--max-updates", type=int, default=1_000)
    p.add_argument("--prompt-chars", type=int, nargs=2, default=(8, 200), metavar=("MIN", "MAX"))
    p.add_argument("--output-tokens", type=int, nargs=2, default=(8, 128), metavar=("MIN", "MAX"))
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--bucket-mb", type=float, default=64.0, help="the trainer's bucket size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline-only", action="store_true", help="no trainer, no updates: the baseline phase alone")
    p.add_argument("--one-call", action="store_true", help="the trainer sends each update in one call where the "
                   "server offers it (/sync_weights: the pause on its first message, the continue on its last)")
    p.add_argument("--trace", action="store_true", help="trace the server and the clients; explain gaps and "
                                                        "slow first tokens (see load_trace.py)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not 1 <= args.clients <= 64:
        p.error("--clients must be 1 to 64")
    if args.baseline_s is None:
        args.baseline_s = min(60.0, max(2.0, args.duration_s / 2))
    if args.prompt_chars[1] + args.output_tokens[1] >= args.max_model_len:
        p.error("the longest prompt (one token per character) plus the longest output must fit --max-model-len")
    return args


def run_load(name: str, url: str, args, seconds: float, trainer: TrainerProcess | None, seed: int | None = None,
             probe: ClientProbe | None = None):
    """One phase with a progress bar; (records, start, deadline, end). Both measured phases
    send the same seeded requests in the same order (``seed``: another sequence)."""
    bar = tqdm(total=round(seconds), desc=name, unit="s", leave=False, disable=None)  # none in a log: no terminal
    t0 = time.monotonic()

    def tick(records):
        if trainer is not None:
            trainer.poll()
        bar.n = min(round(time.monotonic() - t0), bar.total)
        bar.set_postfix(requests=len(records), tokens=sum(r.tokens for r in records),
                        updates=len(trainer.updates) if trainer else 0, refresh=True)

    if trainer is not None:
        trainer.go(t0, t0 + seconds)
    try:
        return asyncio.run(run_phase(url, args.clients, seconds, args.max_requests,
                                     args.seed if seed is None else seed, args.prompt_chars,
                                     args.output_tokens, tick, probe))
    finally:
        bar.close()


def phase_summary(records, start: float, deadline: float, end: float) -> dict:
    done = [r for r in records if r.outcome == "completed"]
    times = arrivals(records)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"seconds": end - start, "requests": len(records), "completed": len(done),
            "aborted_by_pause": sum(r.outcome == "aborted_by_pause" for r in records),
            "errors": sum(r.outcome == "error" for r in records),
            "error_examples": [r.error for r in records if r.outcome == "error"][:5],
            "paused_retries": sum(r.paused_retries for r in records),
            "tokens": sum(r.tokens for r in done), "tokens_per_s": throughput(records, start, deadline),
            "merged_gap_p99_s": percentile(gaps, 99), "merged_gap_max_s": max(gaps, default=None),
            **latencies(records)}


def update_summary(u: dict, times: list[float], since: float | None = None) -> dict:
    """One update's row; ``since``: when the previous update's window closed (see ``stall``)."""
    out = {k: u.get(k) for k in ("update", "transport", "mode", "version", "messages", "num_aborted_requests",
                                 "flush_tries", "error")}
    out["own_ms"] = u["own_ms"]

    def span_ms(a: str, b: str):
        return 1e3 * (u[b] - u[a]) if u.get(a) is not None and u.get(b) is not None else None

    # The window's parts, as the trainer saw them: the pause call, the flushes (wait mode
    # drains here), the update's messages, the continue call.
    out["pause_ms"], out["flush_ms"] = span_ms("t_pause_sent", "t_paused"), span_ms("t_paused", "t_update_start")
    out["update_wall_ms"], out["continue_ms"] = span_ms("t_update_start", "t_update_end"), span_ms("t_update_end", "t_done")
    out["total_ms"] = span_ms("t_pause_sent", "t_done")
    parts = stall_parts(times, u["t_pause_sent"], u["t_done"], since) if u["t_done"] else None
    out["stall_ms"] = None if parts is None else 1e3 * sum(parts.values())
    out["stall_before_ms"] = None if parts is None else 1e3 * parts["before_s"]
    out["stall_after_ms"] = None if parts is None else 1e3 * parts["after_s"]
    out["stall_over_own"] = out["stall_ms"] / u["own_ms"] if parts is not None and u["own_ms"] > 0 else None
    # Against the whole window the trainer drove (pause to continue replied): above 1 only
    # by what came before the pause and after the continue.
    out["stall_over_whole"] = out["stall_ms"] / out["total_ms"] if parts is not None and out["total_ms"] else None
    return out


def stall_goal(updates: list[dict]) -> dict:
    """The serving goal's figure (the p99 over updates of stall / the update's own time,
    goal <= 2) overall and per transport, with the medians of the stall's parts: where a
    stall goes when the figure is over the goal."""
    def summary(us):
        def med(key):
            return percentile([u[key] for u in us if u[key] is not None], 50)
        return {"updates": len(us), "p99_stall_over_own": percentile([u["stall_over_own"] for u in us
                                                                      if u["stall_over_own"] is not None], 99),
                "p99_stall_over_whole": percentile([u["stall_over_whole"] for u in us
                                                    if u["stall_over_whole"] is not None], 99),
                **{f"median_{k}": med(k) for k in ("own_ms", "stall_ms", "stall_before_ms", "pause_ms", "flush_ms",
                                                   "update_wall_ms", "continue_ms", "stall_after_ms")}}
    out = {"all": summary(updates)}
    for t in dict.fromkeys(u["transport"] for u in updates):
        out[t] = summary([u for u in updates if u["transport"] == t])
    return out


def served_outputs(url: str) -> dict:
    """The server's greedy outputs for the check prompts, whole and streamed, and its version."""
    import json

    body = {"text": CHECK_PROMPTS, "sampling_params": CHECK_PARAMS}
    whole = [o["output_ids"] for o in httpx.post(f"{url}/generate", json=body, timeout=600).json()]
    # The streamed run must compute its prompts as the whole run did, not find them cached
    # (a cache hit may change the last bits of a logit, and a near tie with them).
    httpx.get(f"{url}/flush_cache", timeout=60).raise_for_status()
    streamed = [None] * len(CHECK_PROMPTS)
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ev = json.loads(line[len("data: "):])
                if ev["meta_info"]["finish_reason"] is not None:
                    streamed[ev["index"]] = ev["output_ids"]
    version = httpx.get(f"{url}/get_weight_version", timeout=60).json()["weight_version"]
    return {"whole": whole, "streamed": streamed, "version": version}


def cold_outputs(path, device: str, engine_kwargs: dict) -> list:
    from course_lib import Engine

    engine = Engine(path, device=device, **engine_kwargs)
    out = [o["output_ids"] for o in engine.generate(CHECK_PROMPTS, CHECK_PARAMS)]
    del engine
    return out


def main(argv=None) -> dict:
    args = parse(argv)
    res = run_header("serve-load", args.device, preset=args.preset, clients=args.clients,
                     duration_s=args.duration_s, baseline_s=args.baseline_s, update_every_s=args.update_every_s,
                     prompt_chars=list(args.prompt_chars), output_tokens=list(args.output_tokens), seed=args.seed)
    engine_kwargs = {"max_num_seqs": args.clients, "max_model_len": args.max_model_len}
    draw = args.device if is_cuda(args.device) else "cpu"
    traces = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = [make_random(f"{tmp}/ckpt{i}", args.preset, seed=args.seed * 10 + 1 + i, device=draw)
                 for i in range(1 if args.baseline_only else 3)]
        server, trainer, loaded = ServerProcess(ckpts[0], args.device, engine_kwargs, trace=args.trace), None, None
        try:
            url = server.start()
            serving_since = time.monotonic()
            served_outputs(url)  # warm up both paths before any clock
            if args.warmup_s > 0:  # the first requests of each shape pay for allocations, not serving
                run_load("warm-up", url, args, args.warmup_s, None, seed=args.seed + 7919)  # not the measured prompts
            if not args.baseline_only:
                trainer = TrainerProcess(url, ckpts, args.device, args.update_every_s, args.max_updates,
                                         max(4096, int(args.bucket_mb * (1 << 20)) // 4096 * 4096),  # aligned
                                         one_call=args.one_call)
                ready = trainer.start()
                res["registered_buckets"], res["one_call"] = ready["buckets"], ready["one_call"]
            base = traced_load("baseline, no updates", url, args, args.baseline_s, None, server, traces, "baseline")
            if trainer is not None:
                loaded = traced_load("with updates", url, args, args.duration_s, trainer, server, traces,
                                     "with_updates")
                trainer.finish()
            hot = served_outputs(url)
            if args.trace:  # the warm-up's too: a compile there is one a client would wait for
                res["compiles_while_serving"] = server.trace(serving_since, time.monotonic())["compiles"]
        finally:
            if trainer is not None and trainer.process.exitcode is None:
                trainer.process.kill()
            server.stop()
        applied = [u for u in trainer.updates if u["error"] is None] if trainer else []
        last = applied[-1] if applied else None
        cold = cold_outputs(ckpts[last["checkpoint"] if last else 0], args.device, engine_kwargs)
    summarize(res, base, loaded, trainer, hot, cold, last)
    for name, (server_trace, client_trace) in traces.items():
        phase = base if name == "baseline" else loaded
        res[name]["explained"] = explain(phase[0], arrivals(phase[0]), server_trace, client_trace)
        res.setdefault("trace", {})[name] = {"server": server_trace, "clients": client_trace}
    report(res)
    save_json(res, args.json)
    return res


def traced_load(name: str, url: str, args, seconds: float, trainer, server: ServerProcess, traces: dict, key: str):
    """``run_load``; with ``--trace``, the server's and the clients' traces of the phase go
    into ``traces[key]``."""
    probe = ClientProbe() if args.trace else None
    phase = run_load(name, url, args, seconds, trainer, probe=probe)
    if args.trace:
        _, start, _, end = phase
        traces[key] = (server.trace(start, end), probe.snapshot(start, end))
    return phase


def summarize(res: dict, base, loaded, trainer: TrainerProcess | None, hot: dict, cold: list,
              last: dict | None) -> None:
    """The results; without a trainer (``--baseline-only``) the baseline alone, no updates."""
    res["baseline"] = phase_summary(*base)
    updates = trainer.updates if trainer else []
    res["with_updates"] = phase_summary(*loaded) if loaded else None
    times = arrivals(loaded[0]) if loaded else []
    ends = [None] + [u["t_done"] or u["t_pause_sent"] for u in updates]  # a failed one: its start
    res["updates"] = [update_summary(u, times, since) for u, since in zip(updates, ends)]
    res["stall_goal"] = stall_goal(res["updates"])
    res["trainer_failure"] = trainer.failure if trainer else None
    stale = count_stale(base[0] + (loaded[0] if loaded else []), updates, INITIAL_VERSION)
    res["stale_tokens"], res["tokens_checked"] = stale["stale"], stale["checked"]
    res["unknown_versions"], res["stale_examples"] = stale["unknown"], stale["examples"]
    res["errors"] = (res["baseline"]["errors"] + (res["with_updates"] or {}).get("errors", 0) + stale["unknown"]
                     + sum(u["error"] is not None for u in updates) + (res["trainer_failure"] is not None))
    res["served_version"] = hot["version"]
    res["hot_equals_cold"] = (hot["whole"] == cold and hot["streamed"] == cold
                              and hot["version"] == (last["version"] if last else INITIAL_VERSION))
    base_tps = res["baseline"]["tokens_per_s"]
    res["throughput_ratio"] = res["with_updates"]["tokens_per_s"] / base_tps if base_tps and loaded else None


def ms(x) -> str:
    return "-" if x is None else f"{1e3 * x:8.1f}"


def report(res: dict) -> None:
    print(f"\nserve-load, preset {res['preset']}, {res['clients']} clients, {res['hardware']}, {res['date']}")
    print(f"{'phase':<14}{'s':>6}{'done':>7}{'aborted':>8}{'errors':>7}{'tok/s':>10}"
          f"{'ttft p50':>10}{'p99':>9}{'itl p50':>9}{'p99':>9}  (ms)")
    for name in ("baseline", "with_updates"):
        p = res[name]
        if p is None:
            continue
        print(f"{name:<14}{p['seconds']:6.1f}{p['completed']:7d}{p['aborted_by_pause']:8d}{p['errors']:7d}"
              f"{p['tokens_per_s']:10.1f}{ms(p['ttft_p50_s']):>10}{ms(p['ttft_p99_s']):>9}"
              f"{ms(p['itl_p50_s']):>9}{ms(p['itl_p99_s']):>9}")
    b = res["baseline"]
    print(f"baseline: longest gap between tokens, all clients merged: {ms(b['merged_gap_max_s']).strip()} ms "
          f"(p99 {ms(b['merged_gap_p99_s']).strip()} ms)")
    for name in ("baseline", "with_updates"):
        if res[name] is not None and "explained" in res[name]:
            print("\n".join(report_lines(name, res[name]["explained"])))
    if "compiles_while_serving" in res:
        c = res["compiles_while_serving"]
        print(f"Triton compiles from the first request to the last (warm-up included): {len(c)}"
              + "".join(f"\n  {x['kernel']} {x['t1'] - x['t0']:.3f} s, unaligned pointers {x['unaligned']}" for x in c))
    if res["with_updates"] is None:
        print(f"errors {res['errors']}, hot == cold {res['hot_equals_cold']} (served version {res['served_version']})")
        return
    print(f"{'update':>6} {'transport':<11}{'mode':<9}{'msgs':>5}{'own ms':>9}{'whole ms':>10}{'stall ms':>10}"
          f"{'stall/own':>10}{'aborted':>8}  error")
    for u in res["updates"]:
        ratio = "-" if u["stall_over_own"] is None else f"{u['stall_over_own']:.1f}"
        stall_ms = "-" if u["stall_ms"] is None else f"{u['stall_ms']:.1f}"
        whole = "-" if u["total_ms"] is None else f"{u['total_ms']:.1f}"
        print(f"{u['update']:>6} {u['transport']:<11}{u['mode']:<9}{u['messages']:>5}{u['own_ms']:9.1f}{whole:>10}"
              f"{stall_ms:>10}{ratio:>10}{u['num_aborted_requests'] or 0:>8}  {u['error'] or ''}")
    print("stall per update: p99 of stall / own time (goal <= 2), p99 of stall / the whole window (pause sent to "
          "continue replied), and medians (ms) of the own time, the stall and its parts: the last token before the "
          "pause, the pause, flush, update and continue calls, the first token after")
    print(f"{'updates':<12}{'n':>4}{'p99 s/own':>10}{'s/whole':>8}{'own':>8}{'stall':>8}{'before':>8}{'pause':>8}{'flush':>8}"
          f"{'update':>8}{'cont.':>8}{'after':>8}")
    def f(x, fmt="8.1f"):
        return f"{'-':>8}" if x is None else format(x, fmt)

    for name, g in res["stall_goal"].items():
        print(f"{name:<12}{g['updates']:>4}{f(g['p99_stall_over_own'], '10.1f')}{f(g['p99_stall_over_whole'])}" + "".join(
            f(g[f"median_{k}"]) for k in ("own_ms", "stall_ms", "stall_before_ms", "pause_ms", "flush_ms",
                                          "update_wall_ms", "continue_ms", "stall_after_ms")))
    ratio = res["throughput_ratio"]
    print(f"throughput with updates / without: {'-' if ratio is None else f'{ratio:.2f}'}")
    print(f"errors {res['errors']}, stale tokens {res['stale_tokens']} of {res['tokens_checked']}, "
          f"hot == cold {res['hot_equals_cold']} (served version {res['served_version']})"
          + (f"\ntrainer failed: {res['trainer_failure']}" if res["trainer_failure"] else ""))


if __name__ == "__main__":
    main()
