"""Which way of copying a registered update's pieces runs closest to the copy limit (GPU).

    python -m course_lib.bench copy-kernels --preset qwen3-1.7b --json out.json

One engine, one registration (a resident trainer in this process: its weights live in
the registered buffer), every bucket copied in one call per setting: the scatter kernel
(``weights/commit/scatter_copy.py``) with each chunk size, block and warp count; a ``copy_``
loop and a CUDA graph of it. Each
result is checked (every destination equals its source afterwards) and given as a share
of one device-to-device copy of the same bytes measured in the same run. The module's
defaults (``scatter_copy.CHUNK_BYTES``, ``BLOCK``, ``NUM_WARPS``) come from this table.
"""
from __future__ import annotations

import argparse
import itertools
import tempfile

import torch
from tqdm import tqdm

from course_lib import Engine
from course_lib.bench import run_header, save_json
from course_lib.bench.update import copy_baselines, median_time
from course_lib.weights.commit import scatter_copy
from course_lib.weights.checkpoint import CheckpointReader, make_random
from course_lib.weights.transports.registered import RegisteredSender


def check_copied(table) -> None:
    """Every destination of every bucket holds its source's bytes (after zeroing them first)."""
    for srcs, dsts in table.copies:
        for src, dst in zip(srcs, dsts):
            if not torch.equal(src, dst):
                raise AssertionError("a copy setting wrote wrong bytes")


def zero_destinations(table) -> None:
    for _, dsts in table.copies:
        for dst in dsts:
            dst.zero_()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m course_lib.bench copy-kernels")
    p.add_argument("--preset", default="qwen3-1.7b")
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--chunk-kb", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--block", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not scatter_copy.available():
        raise SystemExit("copy-kernels needs a GPU and Triton")
    res = run_header("copy-kernels", "cuda", preset=args.preset, bucket_mb=args.bucket_mb)
    with tempfile.TemporaryDirectory() as tmp:
        a = make_random(f"{tmp}/a", args.preset, seed=1, device="cuda")
        b = make_random(f"{tmp}/b", args.preset, seed=2, device="cuda")
        engine = Engine(a, device="cuda", max_num_seqs=8, max_model_len=512)
        sent = list(CheckpointReader(b).iter_tensors(device="cuda"))
        sender = RegisteredSender(sent, args.bucket_mb << 20, device="cuda", resident=True)
        sender.adopt(sent)
        del sent
        engine.register_weight_buffers(sender.registration(serialized=False), copy_mode="graph")
        table = engine.updater.transfers.registration.table
        every = list(range(table.num_buckets))
        nbytes = sum(table.nbytes)
        res["bytes"], res["buckets"] = nbytes, table.num_buckets
        res["pieces"] = sum(len(srcs) for srcs, _ in table.copies)
        res.update(copy_baselines(nbytes, "cuda"))

        def measure(label: str, run) -> None:
            zero_destinations(table)
            run()
            torch.cuda.synchronize()
            check_copied(table)
            gbps = nbytes / median_time(run, "cuda", repeat=7) / 1e9
            res["settings"][label] = gbps
        res["settings"] = {}
        measure("loop", lambda: table.copy(every, "loop"))
        measure("graph", lambda: table.copy(every, "graph"))
        grid = list(itertools.product(args.chunk_kb, args.block, args.warps))
        for chunk_kb, block, warps in tqdm(grid, desc="scatter settings"):
            tables = [scatter_copy.build_table(*table.copies[k], chunk_bytes=chunk_kb << 10) for k in every]
            if any(t is None for t in tables):
                raise SystemExit("a bucket has unaligned pieces: the scatter kernel cannot copy it")

            def run(tables=tables, block=block, warps=warps):
                for t in tables:
                    scatter_copy.scatter(t, block=block, num_warps=warps)
            measure(f"scatter chunk={chunk_kb}KiB block={block} warps={warps}", run)
        del engine, table
    report(res)
    save_json(res, args.json)
    return res


def report(r: dict) -> None:
    copy = r["copy_gbps"]
    print(f"\ncopy kernels, preset {r['preset']} ({r['bytes'] / 1e9:.2f} GB, {r['pieces']} pieces in "
          f"{r['buckets']} buckets), {r['hardware']}, {r['date']}")
    print(f"  baseline device-to-device copy {copy:8.1f} GB/s")
    ranked = sorted(r["settings"].items(), key=lambda kv: -kv[1])
    for label, gbps in ranked:
        print(f"  {label:<52} {gbps:8.1f} GB/s  {100 * gbps / copy:5.1f}% of copy")


if __name__ == "__main__":
    main()
