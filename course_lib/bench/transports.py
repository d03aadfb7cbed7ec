"""Transports against baselines measured in the same run, on this machine's device:

- broadcast: a trainer process broadcasts a checkpoint in buckets and the engine loads it
  (``update_weights_from_distributed``), against a raw broadcast of the same buckets
  between the same two processes (what the wire alone allows); ``--rounds`` whole updates
  over one group, as an RL trainer's steps: the ratio is the later rounds' median (the
  first also sets the communicator up, and is reported beside it), with the engine's
  phases per round;
- bucketed against per-tensor: the same tensors into the engine through
  ``update_weights_from_tensor``, one call per tensor against one per flattened bucket,
  on a model of many small tensors (where per-call overhead decides);
- a bucket-size sweep of the bucketed update, beside one flat copy of the same bytes.

    python -m course_lib.bench transports --json out.json

Runs on the CPU (gloo) as well as a GPU; a broadcast between GPUs needs two of them, so on
a single-GPU machine the broadcast part runs over gloo from host memory. With ``--two-gpus``
(a machine with two): only the broadcast, over NCCL, the trainer and the raw sender on
``cuda:0``, the engine and the raw receiver on ``cuda:1``:

    python -m course_lib.bench transports --two-gpus --broadcast-preset qwen3-1.7b --bucket-mb 512
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from course_lib import Engine
from course_lib.bench import run_header, save_json
from course_lib.bench.update import median_time, sync
from course_lib.dtypes import parse_dtypes
from course_lib.weights.transports import bucket
from course_lib.weights.checkpoint import CheckpointReader, make_random, preset, random_state_dict
from course_lib.weights.transports import dist as dist_transport
from course_lib.weights.transports.dist import free_port
from course_lib.weights.transports import trainer
from course_lib.weights.transports.ipc import group_into_buckets

CTX = mp.get_context("spawn")
# Many small tensors: 24 layers of small matrices (267 tensors, ~15 MB in float32).
MANY_SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=24, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32)
SWEEP = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
# The broadcast's model: fewer, larger tensors (~125 MB in float32), so the wire shows.
BROADCAST_MODEL = dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=64)


def raw_broadcast_sender(port: int, sizes: list[int], ready, backend: str = "gloo", device: str = "cpu",
                         rounds: int = 1) -> None:
    """Rank 0 of a plain group: one warm-up broadcast, then ``rounds`` times one per bucket size."""
    trainer.share_cores(device)
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator lives on the current device
    group, _store = dist_transport.new_group("127.0.0.1", port, 0, 2, "raw", backend)
    dist_transport.broadcast_async(group, torch.zeros(16, dtype=torch.uint8, device=device)).wait()
    buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
    ready.put(True)
    for _ in range(rounds):
        pipelined(group, buffers)
    sync(device)


def pipelined(group, buffers, in_flight: int = 2) -> None:
    """Broadcast (or receive) ``buffers`` in turn, ``in_flight`` at a time, as the trainer does."""
    works = []
    for buf in buffers:
        if len(works) == in_flight:
            works.pop(0).wait()
        works.append(dist_transport.broadcast_async(group, buf))
    for work in works:
        work.wait()


def raw_broadcast(sizes: list[int], backend: str = "gloo", sender_device: str = "cpu", device: str = "cpu",
                  rounds: int = 1) -> float:
    """GB/s of broadcasting buffers of ``sizes`` bytes from another process, two in flight
    (as the trainer sends them), with nothing else done to them (received on ``device``):
    the median of ``rounds`` rounds over one group."""
    port, ready = free_port(), CTX.Queue()
    child = CTX.Process(target=raw_broadcast_sender, args=(port, sizes, ready, backend, sender_device, rounds))
    child.start()
    group, _store = dist_transport.new_group("127.0.0.1", port, 1, 2, "raw", backend)
    dist_transport.broadcast_async(group, torch.zeros(16, dtype=torch.uint8, device=device)).wait()
    sync(device)
    ready.get(timeout=120)
    buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
    seconds = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        pipelined(group, buffers)
        sync(device)  # an NCCL wait only orders the stream: the bytes have arrived once it is done
        seconds.append(time.perf_counter() - t0)
    trainer.wait_for_exit(child)
    return sum(sizes) / sorted(seconds)[len(seconds) // 2] / 1e9


def broadcast_update(engine: Engine, path, bucket_bytes: int, backend: str = "gloo",
                     trainer_device: str = "cpu", rounds: int = 3) -> dict:
    """A trainer process broadcasts ``path`` over one group, round after round (an RL
    trainer's steps); GB/s of the engine's receive-and-load per round. The first round also
    sets the group's communicator up (NCCL creates it at the first collective) and builds
    the engine's receive buffers and copy tables; the later ``rounds - 1`` are the steady
    state. On a GPU, ``rounds - 1`` more follow with the overlap switched off (the host
    waits for each bucket's copy before the next is received): where the time goes."""
    cuda = engine.config.is_cuda
    serial = rounds - 1 if cuda and rounds > 1 else 0
    port, announcements, results = free_port(), CTX.Queue(), CTX.Queue()
    child = CTX.Process(target=trainer.push_broadcast, args=(path, port, announcements, bucket_bytes),
                        kwargs={"results": results, "group_name": "bench", "backend": backend,
                                "device": trainer_device, "rounds": rounds + serial})
    child.start()
    engine.init_weights_update_group("127.0.0.1", port, 1, 2, "bench", backend)
    engine.pause_generation("abort")
    per_round, sizes = [], []
    for r in range(rounds + serial):
        if r == rounds:
            engine.updater.transfers.receive_pool("bench").overlap = False
        nbytes, engine_s, phases_ms = 0, 0.0, {}
        request = announcements.get(timeout=300)
        t0 = time.perf_counter()
        while request is not None:
            t = time.perf_counter()
            result = engine.update_weights_from_distributed(**request, group_name="bench", flush_cache=False)
            engine_s += time.perf_counter() - t
            nbytes += result["bytes"]
            for phase, ms in result["timings_ms"].items():
                phases_ms[phase] = phases_ms.get(phase, 0.0) + ms
            if r == 0:
                dtypes = parse_dtypes(request["dtypes"])
                sizes.append(bucket.layout(request["names"], dtypes, request["shapes"])[-1].end_idx)
            request = announcements.get(timeout=300)
        sync(engine.config.device)  # the last copies may still run on the device
        total = time.perf_counter() - t0
        per_round.append({"seconds": total, "gbps": nbytes / total / 1e9, "engine_side_gbps": nbytes / engine_s / 1e9,
                          "overlap": r < rounds, "engine_phases_ms": phases_ms,
                          "trainer": results.get(timeout=300)})
    trainer.wait_for_exit(child)
    engine.destroy_weights_update_group("bench")
    engine.flush_cache()
    engine.continue_generation()

    def median(rows):
        rows = sorted(rows, key=lambda x: x["gbps"])
        return rows[len(rows) // 2] if rows else None
    warm = median(per_round[1:rounds] or per_round[:1])
    waited = median(per_round[rounds:])
    return {"bytes": nbytes, "buckets": len(sizes), "bucket_sizes": sizes, "rounds": per_round,
            "first_round_gbps": per_round[0]["gbps"], "gbps": warm["gbps"],
            "engine_side_gbps": warm["engine_side_gbps"], "trainer": warm["trainer"],
            "waiting_each_bucket_gbps": None if waited is None else waited["gbps"]}


def in_memory(engine: Engine, tensors: list, bucket_bytes: int | None, device: str) -> float:
    """GB/s of ``update_weights_from_tensor``: one call per tensor (``bucket_bytes`` None)
    or one per flattened bucket (packed beforehand, as a trainer would)."""
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    if bucket_bytes is None:
        calls = [([pair], None) for pair in tensors]
    else:
        calls = [(bucket.pack(g), "flattened_bucket") for g in group_into_buckets(tensors, bucket_bytes)]

    def run():
        for payload, load_format in calls:
            engine.update_weights_from_tensor(payload, load_format=load_format, flush_cache=False)
    return nbytes / median_time(run, device, repeat=5) / 1e9


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m course_lib.bench transports")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--broadcast-preset", default=None,
                   help="a preset for the broadcast part (default: a ~125 MB model of a few large tensors)")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="bucket size of the broadcast and of the A/B")
    p.add_argument("--two-gpus", action="store_true",
                   help="only the broadcast, over NCCL from cuda:0 (trainer) to cuda:1 (engine)")
    p.add_argument("--rounds", type=int, default=3,
                   help="whole updates over one group; the later ones (the steady state) are reported")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def broadcast_part(tmp: str, args, device: str, backend: str, trainer_device: str, bucket_bytes: int) -> dict:
    """The engine's update over a broadcast against the raw wire: same buckets, same two processes."""
    model = args.broadcast_preset or preset("small", **BROADCAST_MODEL)
    a = make_random(f"{tmp}/a", model, seed=1)
    b = make_random(f"{tmp}/b", model, seed=2)
    engine = Engine(a, device=device)
    out = broadcast_update(engine, b, bucket_bytes, backend, trainer_device, args.rounds)
    out["raw_gbps"] = raw_broadcast(out["bucket_sizes"], backend, trainer_device,
                                    device if backend == "nccl" else "cpu", args.rounds)
    out["of_raw"] = out["gbps"] / out["raw_gbps"]
    out["preset"] = args.broadcast_preset or "125 MB, 8 layers"
    out["checkpoint_bytes"] = CheckpointReader(b).nbytes()
    return out


def many_small_part(tmp: str, device: str, bucket_bytes: int, res: dict, steps) -> None:
    """Many small tensors: per-tensor calls, buckets, and a sweep of bucket sizes."""
    config = preset("small", **MANY_SMALL)
    folder = Path(tmp) / "many"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict()))
    engine = Engine(folder, device=device, load_format="dummy", num_kv_blocks=8, enable_cuda_graph=False)
    engine.updater.waiting_for_weights = False  # only updates are timed here, nothing is served
    tensors = list(random_state_dict(config, seed=3, device=device).items())
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    small = res["many_small"] = {"tensors": len(tensors), "bytes": nbytes,
                                 "flat_copy_gbps": nbytes / median_time(lambda: dst.copy_(src), device) / 1e9}
    steps.update()
    small["per_tensor_gbps"] = in_memory(engine, tensors, None, device)
    small["bucketed_gbps"] = in_memory(engine, tensors, bucket_bytes, device)
    small["bucketed_over_per_tensor"] = small["bucketed_gbps"] / small["per_tensor_gbps"]
    steps.update()
    res["sweep"] = []
    for size in SWEEP:
        gbps = in_memory(engine, tensors, size, device)
        res["sweep"].append({"bucket_bytes": size, "gbps": gbps, "of_flat_copy": gbps / small["flat_copy_gbps"]})
        steps.update()
    sync(device)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device, backend, trainer_device = args.device, "gloo", "cpu"
    if args.two_gpus:
        if torch.cuda.device_count() < 2:
            raise SystemExit("--two-gpus needs two CUDA devices; this machine has "
                             f"{torch.cuda.device_count()}")
        device, backend, trainer_device = "cuda:1", "nccl", "cuda:0"
        torch.cuda.set_device(device)
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    res = run_header("transports", device, bucket_bytes=bucket_bytes)
    res["broadcast_backend"] = backend
    steps = tqdm(total=2 if args.two_gpus else 4 + len(SWEEP), desc="transports benchmark")
    with tempfile.TemporaryDirectory() as tmp:
        res["broadcast"] = broadcast_part(tmp, args, device, backend, trainer_device, bucket_bytes)
        steps.update(2)
        if not args.two_gpus:
            many_small_part(tmp, device, bucket_bytes, res, steps)
    steps.close()
    report(res)
    save_json(res, args.json)
    return res


def report(r: dict) -> None:
    b = r["broadcast"]
    print(f"\ntransports on {r['hardware']} ({r['device']}), {r['date']}")
    print(f"  broadcast update over {r.get('broadcast_backend', 'gloo')}, {b['preset']} ({b['bytes'] / 1e6:.1f} MB "
          f"in {b['buckets']} buckets)  "
          f"{b['gbps']:7.2f} GB/s = {b['of_raw']:.0%} of a raw broadcast of the same buckets ({b['raw_gbps']:.2f} GB/s); "
          f"inside the engine's calls {b['engine_side_gbps']:.2f} GB/s; the first round {b['first_round_gbps']:.2f} GB/s")
    if b.get("waiting_each_bucket_gbps"):
        print(f"    waiting for each bucket's copy before the next (no overlap): {b['waiting_each_bucket_gbps']:.2f} GB/s "
              f"= {b['waiting_each_bucket_gbps'] / b['raw_gbps']:.0%} of raw")
    for i, rnd in enumerate(b.get("rounds", [])):
        phases = ", ".join(f"{k} {v:.1f}" for k, v in rnd["engine_phases_ms"].items())
        print(f"    round {i + 1}{'' if rnd['overlap'] else ' (no overlap)'}: {rnd['seconds'] * 1e3:8.1f} ms, "
              f"{rnd['gbps']:7.2f} GB/s; engine phases (ms): {phases}")
    if "many_small" not in r:
        return
    m = r["many_small"]
    print(f"  many small tensors ({m['tensors']}, {m['bytes'] / 1e6:.1f} MB): per-tensor calls {m['per_tensor_gbps']:.2f} GB/s, "
          f"buckets {m['bucketed_gbps']:.2f} GB/s ({m['bucketed_over_per_tensor']:.1f}x); one flat copy {m['flat_copy_gbps']:.1f} GB/s")
    for row in r["sweep"]:
        print(f"    bucket {row['bucket_bytes'] >> 10:6d} KiB: {row['gbps']:6.2f} GB/s ({row['of_flat_copy']:.0%} of one flat copy)")
