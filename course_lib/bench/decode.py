"""Decode time per step, CUDA graphs against eager, at several batch sizes.

    python -m course_lib.bench decode --preset qwen3-0.6b --batch 1 8 --json out.json

Builds a random checkpoint (on the GPU when there is one), starts one engine with graphs
and one without, prefills ``batch`` prompts, then times ``steps`` decode steps (the
model runner alone, synchronised). Prints ms/step for both and the eager/graph ratio.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch
from tqdm import tqdm

from course_lib import Engine
from course_lib.bench import run_header, save_json
from course_lib.config import is_cuda
from course_lib.weights.checkpoint import make_random


def sync(device):
    if is_cuda(device):
        torch.cuda.synchronize()


def time_decode(engine: Engine, batch: int, steps: int, warmup: int = 20) -> float:
    """Median seconds per decode step for ``batch`` running requests (after ``warmup``
    steps, which also bring an idle GPU's clocks up)."""
    params = {"max_new_tokens": steps + warmup + 2, "temperature": 0, "ignore_eos": True}
    for i in range(batch):
        engine.add_request(input_ids=[(7 * i + j) % 250 + 1 for j in range(16)], sampling_params=params)
    seqs, is_prefill = engine.scheduler.schedule()
    assert is_prefill and len(seqs) == batch
    engine.scheduler.postprocess(seqs, engine.model_runner.run(seqs, True), engine.weight_version)
    times = []
    for k in range(warmup + steps):
        seqs, is_prefill = engine.scheduler.schedule()
        assert not is_prefill and len(seqs) == batch
        sync(engine.config.device)
        t0 = time.perf_counter()
        tokens = engine.model_runner.run(seqs, False)  # sampling reads the logits: a sync
        dt = time.perf_counter() - t0
        engine.scheduler.postprocess(seqs, tokens, engine.weight_version)
        if k >= warmup:
            times.append(dt)
    while engine.has_unfinished_requests():
        engine.step()
    return sorted(times)[len(times) // 2]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m course_lib.bench decode")
    p.add_argument("--preset", default="qwen3-0.6b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    modes = [("eager", False)] + ([("graph", True)] if is_cuda(args.device) else [])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        gen_device = args.device if is_cuda(args.device) else "cpu"
        path = make_random(f"{tmp}/ckpt", args.preset, seed=0, device=gen_device)
        for name, graphs in tqdm(modes, desc="engines"):
            engine = Engine(path, device=args.device, enable_cuda_graph=graphs,
                            max_num_seqs=max(args.batch), max_model_len=args.max_model_len)
            for b in args.batch:
                rows.append({"mode": name, "batch": b, "ms_per_step": 1e3 * time_decode(engine, b, args.steps),
                             "startup_s": engine.timings["startup_s"]})
            del engine
            if is_cuda(args.device):
                torch.cuda.empty_cache()
    print(f"\ndecode step, preset {args.preset}, device {args.device}")
    print(f"{'batch':>5} " + " ".join(f"{m:>12}" for m, _ in modes) + ("   eager/graph" if len(modes) > 1 else ""))
    for b in args.batch:
        ms = {r["mode"]: r["ms_per_step"] for r in rows if r["batch"] == b}
        line = f"{b:>5} " + " ".join(f"{ms[m]:>9.3f} ms" for m, _ in modes)
        if "graph" in ms:
            line += f"   {ms['eager'] / ms['graph']:>10.1f}x"
        print(line)
    result = run_header("decode", args.device, preset=args.preset, steps=args.steps, rows=rows)
    save_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
