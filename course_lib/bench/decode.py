"""Decode time per step, CUDA graphs against eager, at several batch sizes.

    python -m course_lib.bench decode --preset qwen3-0.6b --batch 1 8 --json out.json

Builds a random checkpoint (on the GPU when there is one), starts one engine with graphs
and one without, prefills ``batch`` prompts, then times ``steps`` decode steps (the
model runner alone, synchronised: inputs built, the step, the tokens read back). Prints
ms/step for both and the eager/graph ratio. On a GPU it also times graphs over plain
torch ops (``COURSE_LIB_FUSED_KERNELS=0``: what the fused kernels save, same run) and
states the step's roofline: the weights' bytes read once at the rate a device-to-device
copy of 1 GiB reaches in the same run (bytes read plus bytes written per second).
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch
from tqdm import tqdm

from course_lib import Engine, settings
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


def profile_decode(engine: Engine, batch: int, steps: int = 5) -> str:
    """torch.profiler's table (kernels by GPU time) over ``steps`` eager decode steps."""
    from torch.profiler import ProfilerActivity, profile
    params = {"max_new_tokens": steps + 8, "temperature": 0, "ignore_eos": True}
    for i in range(batch):
        engine.add_request(input_ids=[(5 * i + j) % 250 + 1 for j in range(16)], sampling_params=params)
    engine.step()  # the prefill
    engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    return f"eager decode, batch {batch}, {steps} steps:\n" + prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)


def device_rw_gbps(device: str, nbytes: int = 1 << 30) -> float:
    """Bytes read plus bytes written per second by a device-to-device copy (GB/s)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / sorted(times[1:])[2] / 1e9


def weight_bytes(engine: Engine) -> int:
    """Bytes of the model's distinct weight storages (a tied LM head counted once)."""
    seen = {}
    for p in engine.model.parameters():
        seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m course_lib.bench decode")
    p.add_argument("--preset", default="qwen3-0.6b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--profile", action="store_true",
                   help="also print torch.profiler's kernel table for a few eager decode steps at the first batch size")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    # (name, CUDA graphs, fused kernels): on a GPU graphs with and without the fused kernels
    modes = [("eager", False, True)] + ([("graph", True, True), ("graph-torch-ops", True, False)]
                                        if is_cuda(args.device) else [])
    extra = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        gen_device = args.device if is_cuda(args.device) else "cpu"
        path = make_random(f"{tmp}/ckpt", args.preset, seed=0, device=gen_device)
        for name, graphs, fused_kernels in tqdm(modes, desc="engines"):
            with settings.overridden("COURSE_LIB_FUSED_KERNELS", "1" if fused_kernels else "0"):
                engine = Engine(path, device=args.device, enable_cuda_graph=graphs,
                                max_num_seqs=max(args.batch), max_model_len=args.max_model_len)
                for b in args.batch:
                    rows.append({"mode": name, "batch": b, "ms_per_step": 1e3 * time_decode(engine, b, args.steps),
                                 "startup_s": engine.timings["startup_s"]})
                if args.profile and name == "eager" and is_cuda(args.device):
                    print(profile_decode(engine, args.batch[0]))
            if is_cuda(args.device) and not extra:
                extra["weight_bytes"] = weight_bytes(engine)
            del engine
            if is_cuda(args.device):
                torch.cuda.empty_cache()
    if extra:
        extra["device_rw_gbps"] = device_rw_gbps(args.device)
        extra["roofline_ms"] = 1e3 * extra["weight_bytes"] / (extra["device_rw_gbps"] * 1e9)
    print(f"\ndecode step, preset {args.preset}, device {args.device}")
    names = [m for m, *_ in modes]
    print(f"{'batch':>5} " + " ".join(f"{m:>16}" for m in names)
          + ("   eager/graph  graph/roofline" if len(modes) > 1 else ""))
    for b in args.batch:
        ms = {r["mode"]: r["ms_per_step"] for r in rows if r["batch"] == b}
        line = f"{b:>5} " + " ".join(f"{ms[m]:>13.3f} ms" for m in names)
        if "graph" in ms:
            line += f"   {ms['eager'] / ms['graph']:>10.1f}x  {ms['graph'] / extra['roofline_ms']:>13.2f}x"
        print(line)
    if extra:
        print(f"roofline: {extra['weight_bytes'] / 1e9:.2f} GB of weights at {extra['device_rw_gbps']:.0f} GB/s "
              f"(device copy, read + write) = {extra['roofline_ms']:.2f} ms")
    result = run_header("decode", args.device, preset=args.preset, steps=args.steps, rows=rows, **extra)
    save_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
