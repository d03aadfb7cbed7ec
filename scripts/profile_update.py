"""Where an update's (or a first token's) time goes: torch.profiler's tables, GPU and CPU.

    PYTHONPATH=$PWD python scripts/profile_update.py --preset qwen3-8b --what first-token inproc-fp8

``first-token``: ``generate`` of one token on a warm engine (a prefill, no CUDA graph).
``inproc-<q>``: ``update_weights_from_tensor`` with every tensor already on the GPU, into
an engine quantized with ``q`` (``none``, ``int8``, ``fp8``). ``registered``: a resident
registered update (trainer in this process). Each is run twice to warm up, then profiled
once; the tables list the operations by GPU time and by CPU time, with the wall time.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from course_lib import Engine
from course_lib.weights.checkpoint import CheckpointReader, make_random
from course_lib.weights.transports.registered import RegisteredSender


def profiled(label: str, fn, rows: int) -> None:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    print(f"\n=== {label}: {wall * 1e3:.1f} ms wall (profiled) ===")
    averages = prof.key_averages()
    print(averages.table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60))
    print(averages.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))
    sys.stdout.flush()


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-1.7b")
    p.add_argument("--what", nargs="+", default=["first-token", "inproc-none", "inproc-int8", "inproc-fp8"])
    p.add_argument("--rows", type=int, default=12)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        a = make_random(f"{tmp}/a", args.preset, seed=1, device="cuda")
        b = make_random(f"{tmp}/b", args.preset, seed=2, device="cuda")
        sent = list(CheckpointReader(b).iter_tensors(device="cuda"))
        for what in args.what:
            quant = what.split("-", 1)[1] if what.startswith("inproc-") else None
            engine = Engine(a, device="cuda", max_num_seqs=8, max_model_len=512,
                            quantization=None if quant in (None, "none") else quant)
            if what == "first-token":
                profiled(what, lambda: engine.generate("first token", {"max_new_tokens": 1, "temperature": 0}),
                         args.rows)
            elif what.startswith("inproc-"):
                engine.pause_generation("abort")
                profiled(what, lambda: engine.update_weights_from_tensor(sent, flush_cache=False), args.rows)
            elif what == "registered":
                sender = RegisteredSender(sent, 512 << 20, device="cuda", resident=True)
                mine = sender.adopt(sent)
                sender.epoch = engine.register_weight_buffers(sender.registration(serialized=False))["epoch"]
                every = list(range(sender.num_buckets))
                engine.pause_generation("abort")
                profiled(what, lambda: engine.update_weights_from_registered(every, sender.epoch, flush_cache=False),
                         args.rows)
                del mine, sender
            else:
                raise SystemExit(f"unknown --what {what!r}")
            del engine
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
