"""Why hot updates: a cold restart against a hot update of the same weights, same run.

    python -m course_lib.bench hot-vs-cold --preset qwen3-8b --json out.json

Cold: a fresh Python process starts the engine on the new checkpoint and produces its
first token (process start, imports, device init, weight load, KV pool and CUDA-graph
capture, first token; see cold_start.py), timed from the moment it is spawned. Hot: the
running engine pauses, takes the same weights (from a trainer process over IPC, and from
the page-cached checkpoint on disk), resumes and produces a token. Prints the restart's
phases and the ratio restart / hot for each path.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import course_lib
from course_lib import Engine
from course_lib.bench import run_header, save_json
from course_lib.bench.cold_start import phases_from_marks
from course_lib.bench.update import median_time, sync
from course_lib.config import is_cuda
from course_lib.weights.checkpoint import CheckpointReader, make_random
from course_lib.weights.transports import trainer

COLD_START = Path(__file__).with_name("cold_start.py")


def cold_restart(path, device: str, max_model_len: int) -> dict:
    """Seconds per phase of a cold start on ``path`` in a fresh process, and their total.

    The child timestamps the end of each phase; ``phases_from_marks`` turns them into
    seconds, counting from the moment this process spawned the child."""
    # The child runs cold_start.py by path; it must find course_lib even when the package
    # is not installed (running from a checkout).
    env = dict(os.environ)
    root = str(Path(course_lib.__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    spawned_at = time.time()
    out = subprocess.run([sys.executable, str(COLD_START), str(path), "--device", device,
                          "--max-model-len", str(max_model_len)],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"cold start failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    marks = json.loads(out.stdout.strip().splitlines()[-1])["marks"]
    return phases_from_marks(spawned_at, marks)


def hot_ipc(engine: Engine, path, bucket_bytes: int) -> float:
    """Seconds from the first bucket's arrival to the first token after resuming."""
    ctx = mp.get_context("spawn")
    payloads, acks = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=trainer.push_ipc, args=(path, payloads, acks, bucket_bytes, engine.config.device))
    child.start()
    item = payloads.get(timeout=900)  # the trainer is ready: its weights are packed
    t0 = time.perf_counter()
    engine.pause_generation("abort")
    while item is not None:
        receipt, payload = item
        engine.update_weights_from_tensor(payload, load_format="flattened_bucket", flush_cache=False)
        acks.put(receipt)
        item = payloads.get(timeout=900)
    engine.flush_cache()
    engine.continue_generation()
    engine.generate("first token", {"max_new_tokens": 1, "temperature": 0})
    seconds = time.perf_counter() - t0
    trainer.wait_for_exit(child, 900)
    return seconds


def registered_trainer(engine: Engine, path, bucket_bytes: int, rounds: int):
    """A resident trainer process (its weights live in the registered buffer) that will
    send ``rounds`` updates, registered with ``engine`` before any clock starts, as
    registration happens once per run: (process, payloads, acks)."""
    ctx = mp.get_context("spawn")
    payloads, acks = trainer.Channel(ctx), trainer.Channel(ctx)  # see Channel: no feeder thread
    child = ctx.Process(target=trainer.push_registered,
                        args=(path, payloads, acks, bucket_bytes, engine.config.device, 2, rounds, True))
    child.start()
    _, registration = payloads.get(timeout=900)
    acks.put(engine.register_weight_buffers(registration)["epoch"])
    return child, payloads, acks


def hot_registered(engine: Engine, path, bucket_bytes: int) -> float:
    """Seconds from the trainer's message to the first token after resuming, over
    registered buffers: the trainer's weights live in a buffer the engine mapped once
    (registration happens before the clock starts, as it does once per run)."""
    child, payloads, acks = registered_trainer(engine, path, bucket_bytes, rounds=1)
    receipt, message = payloads.get(timeout=900)
    t0 = time.perf_counter()
    engine.pause_generation("abort")
    engine.update_weights_from_registered(**message, flush_cache=True)
    engine.continue_generation()
    engine.generate("first token", {"max_new_tokens": 1, "temperature": 0})
    seconds = time.perf_counter() - t0
    acks.put(receipt)
    payloads.get(timeout=900)  # the round's end
    trainer.wait_for_exit(child, 900)
    engine.unregister_weight_buffers()
    return seconds


def hot_registered_next_token(engine: Engine, path, bucket_bytes: int) -> tuple[float, float]:
    """(seconds from the trainer's message to the next token of a request already
    decoding, seconds of one such decode step with no update). The request is paused in
    ``keep`` mode (SGLang's ``in_place``: frozen with its KV, no re-prefill), the update
    lands over registered buffers, and one engine step gives its next token: the
    latency a running stream sees. Both medians of five on the same engine."""
    child, payloads, acks = registered_trainer(engine, path, bucket_bytes, rounds=6)
    engine.add_request("a stream that keeps decoding", {"max_new_tokens": 200, "temperature": 0,
                                                        "ignore_eos": True})
    for _ in range(3):  # its prefill, then decode steps
        engine.step()
    rounds, steps = [], []
    for _ in range(6):
        receipt, message = payloads.get(timeout=900)
        sync(engine.config.device)
        t0 = time.perf_counter()
        engine.pause_generation("keep")
        engine.update_weights_from_registered(**message, flush_cache=False)
        engine.continue_generation()
        engine.step()  # the stream's next token, on the new weights
        sync(engine.config.device)
        rounds.append(time.perf_counter() - t0)
        acks.put(receipt)
        payloads.get(timeout=900)  # the round's end
        t0 = time.perf_counter()
        engine.step()  # a decode step with no update, for the baseline
        sync(engine.config.device)
        steps.append(time.perf_counter() - t0)
    trainer.wait_for_exit(child, 900)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    engine.step()
    engine.unregister_weight_buffers()
    return sorted(rounds[1:])[2], sorted(steps[1:])[2]  # the first round warms up: median of the other five


def first_token_s(engine: Engine) -> float:
    """Seconds for one first token on the running engine, no update (the goal's decode step)."""
    return median_time(lambda: engine.generate("first token", {"max_new_tokens": 1, "temperature": 0}),
                       engine.config.device)


def copy_s(nbytes: int, device: str) -> float:
    """Seconds for one device-to-device copy (memcpy on CPU) of ``nbytes``, median of 5."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return median_time(lambda: dst.copy_(src), device)


def hot_disk(engine: Engine, path) -> float:
    t0 = time.perf_counter()
    engine.pause_generation("abort")
    engine.update_weights_from_disk(path)
    engine.continue_generation()
    engine.generate("first token", {"max_new_tokens": 1, "temperature": 0})
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m course_lib.bench hot-vs-cold")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bucket-mb", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    gpu = is_cuda(args.device)
    res = run_header("hot-vs-cold", args.device, preset=args.preset)
    with tempfile.TemporaryDirectory() as tmp:
        a = make_random(f"{tmp}/a", args.preset, seed=1, device=args.device if gpu else "cpu")
        b = make_random(f"{tmp}/b", args.preset, seed=2, device=args.device if gpu else "cpu")
        cold_restart(b, args.device, args.max_model_len)  # warm the page cache and the kernel caches
        res["cold"] = cold_restart(b, args.device, args.max_model_len)
        engine = Engine(a, device=args.device, max_model_len=args.max_model_len)
        engine.generate("warm up", {"max_new_tokens": 2, "temperature": 0})
        res["hot_disk_s"] = min(hot_disk(engine, p_) for p_ in (b, a, b))
        res["hot_ipc_s"] = min(hot_ipc(engine, p_, args.bucket_mb << 20) for p_ in (a, b))
        res["hot_registered_s"] = min(hot_registered(engine, p_, args.bucket_mb << 20) for p_ in (a, b))
        res["hot_registered_next_token_s"], res["decode_step_s"] = hot_registered_next_token(
            engine, b, args.bucket_mb << 20)
        res["first_token_s"] = first_token_s(engine)
        res["copy_s"] = copy_s(CheckpointReader(b).nbytes(), args.device)
        del engine
    cold = res["cold"]["total"]
    res["restart_over_hot_ipc"] = cold / res["hot_ipc_s"]
    res["restart_over_hot_disk"] = cold / res["hot_disk_s"]
    res["restart_over_hot_registered"] = cold / res["hot_registered_s"]
    goal = 2 * res["copy_s"] + res["first_token_s"]
    print(f"\ncold restart vs hot update, preset {args.preset}, {res['hardware']}, {res['date']}")
    for phase, s in res["cold"].items():
        print(f"  cold {phase:<28} {s:8.3f} s")
    print(f"  hot update over IPC, to first token {res['hot_ipc_s']:8.3f} s   restart is {res['restart_over_hot_ipc']:7.0f}x slower")
    print(f"  hot update from disk, to first token {res['hot_disk_s']:7.3f} s   restart is {res['restart_over_hot_disk']:7.0f}x slower")
    print(f"  hot update over registered buffers, to first token {res['hot_registered_s'] * 1e3:.1f} ms   restart is "
          f"{res['restart_over_hot_registered']:.0f}x slower")
    print(f"  goal: 2 x copy ({res['copy_s'] * 1e3:.2f} ms) + one first token without an update "
          f"({res['first_token_s'] * 1e3:.1f} ms) = {goal * 1e3:.1f} ms; hot / goal = {res['hot_registered_s'] / goal:.2f}")
    # The goal for a stream already decoding: two copy times plus one decode step.
    goal_next = 2 * res["copy_s"] + res["decode_step_s"]
    print(f"  hot update over registered buffers, to a running stream's next token "
          f"{res['hot_registered_next_token_s'] * 1e3:.1f} ms (one decode step alone: "
          f"{res['decode_step_s'] * 1e3:.1f} ms)")
    print(f"  goal: 2 x copy + one decode step = {goal_next * 1e3:.1f} ms; hot / goal = "
          f"{res['hot_registered_next_token_s'] / goal_next:.2f}")
    save_json(res, args.json)
    return res


if __name__ == "__main__":
    main()
