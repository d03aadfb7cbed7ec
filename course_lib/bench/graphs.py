"""CUDA graphs remember addresses: the rebinding bug and the in-place fix, measured on a GPU.

    python -m course_lib.bench graphs --json out.json

Three engines start on checkpoint A with decode CUDA graphs captured. Then:

- ``rebind``: every parameter is pointed at new memory holding B's values
  (``param.data = new``), the bug; eager prefill now reads B, graph replay still reads A;
- ``in_place``: the engine's own update from disk, which copies B into the same memory;

and a cold engine starts on B. For both, the same decode step (same prompts, same KV,
computed by each engine's own prefill) is replayed; the record holds the largest
difference of its logits from the cold engine's, whether greedy outputs match the cold
engine's, what the address audit says, and the same step run eagerly on the rebound
engine (eager kernels read the parameter's current memory, so the bug hides there).
Decode time per step is measured with graph replay and eagerly. Without CUDA it says so
and exits 0, writing nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from datetime import date

import torch

from course_lib import Engine
from course_lib.config import is_cuda
from course_lib.layers.quant import kernel_tensors
from course_lib.weights.commit.audit import AddressMovedError
from course_lib.weights.checkpoint import make_random, preset

PROMPTS = ["graphs remember addresses", "a second prompt that is somewhat longer than the first", "x" * 40]
# Multiples of 128, the shapes of a real (if small) model; bf16 as on a serving GPU.
SHAPE = dict(vocab_size=4096, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=8, head_dim=64, torch_dtype="bfloat16")


def sync(device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize()


def prefill(engine: Engine, prompts):
    """Queue ``prompts`` and run their prefill step; returns the running sequences."""
    params = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
    for p in prompts:
        engine.add_request(p, params)
    seqs, is_prefill = engine.scheduler.schedule()
    assert is_prefill and len(seqs) == len(prompts)
    engine.scheduler.postprocess(seqs, engine.model_runner.run(seqs, True), engine.weight_version)
    seqs, is_prefill = engine.scheduler.schedule()
    assert not is_prefill and len(seqs) == len(prompts)
    return seqs


@contextlib.contextmanager
def graphs_off(runner, off: bool = True):
    """Within the block the runner replays no graph (decode or prefill): the same padded
    inputs run through the eager kernels, which read the weights' memory as it is now."""
    saved = runner.graph_for, runner.prefill_graphs
    if off:
        runner.graph_for, runner.prefill_graphs = {}, {}
    try:
        yield
    finally:
        runner.graph_for, runner.prefill_graphs = saved


def decode_logits(engine: Engine, prompts, eager: bool = False) -> torch.Tensor:
    """Logits of the first decode step after prefilling ``prompts`` (graph replay unless
    ``eager``, the prefill included); the requests are aborted afterwards so the engine
    is left idle."""
    # The prefill must compute its KV cache from the weights as they are read now, not find
    # an earlier run's blocks in the prefix cache (a graph-replayed prefill on rebound
    # weights leaves the old weights' KV there, which an eager run would then read).
    engine.flush_cache()
    with graphs_off(engine.model_runner, eager):
        seqs = prefill(engine, prompts)
        logits = engine.model_runner.forward_logits(seqs, False).float().clone()
    for seq in seqs:
        engine.scheduler.finish(seq, {"type": "abort", "message": "benchmark"})
        engine.requests.pop(seq.rid, None)
    return logits


def greedy(engine: Engine, n: int = 16) -> list[list[int]]:
    out = engine.generate(PROMPTS, {"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
    return [o["output_ids"] for o in out]


def audit(engine: Engine) -> str:
    try:
        engine.verify_addresses()
    except AddressMovedError as exc:
        engine.updater.unhealthy = None  # this run only reports the verdict; it keeps measuring
        return f"AddressMovedError: {exc}"
    return "clean"


def time_step(engine: Engine, eager: bool, steps: int) -> float:
    """Median ms of one decode step for len(PROMPTS) requests."""
    seqs = prefill(engine, PROMPTS)
    runner = engine.model_runner
    times = []
    with graphs_off(runner, eager):
        for _ in range(steps + 3):
            sync(engine.config.device)
            t0 = time.perf_counter()
            runner.forward_logits(seqs, False)
            sync(engine.config.device)
            times.append(time.perf_counter() - t0)
    for seq in seqs:
        engine.scheduler.finish(seq, {"type": "abort", "message": "benchmark"})
        engine.requests.pop(seq.rid, None)
    times = sorted(times[3:])
    return 1e3 * times[len(times) // 2]


def measure(device: str = "cuda", steps: int = 50, **shape) -> dict:
    """The whole experiment; with device="cpu" it runs eagerly (for testing the code path)."""
    gpu = is_cuda(device)
    config = preset("small", **{**SHAPE, **shape})
    opts = dict(device=device, enable_cuda_graph=gpu, max_num_seqs=4, max_model_len=256)
    with tempfile.TemporaryDirectory() as tmp:
        a = make_random(f"{tmp}/a", config, seed=1, device=device if gpu else "cpu")
        b = make_random(f"{tmp}/b", config, seed=2, device=device if gpu else "cpu")
        cold = Engine(b, **opts)
        cold_logits, cold_tokens = decode_logits(cold, PROMPTS), greedy(cold)

        def compare(engine: Engine, how: str) -> dict:
            logits = decode_logits(engine, PROMPTS)
            eager = decode_logits(engine, PROMPTS, eager=True)
            return {"how": how,
                    "graph_max_abs_diff_vs_cold": (logits - cold_logits).abs().max().item(),
                    "eager_max_abs_diff_vs_cold": (eager - cold_logits).abs().max().item(),
                    "greedy_equals_cold": greedy(engine) == cold_tokens,
                    "audit": audit(engine)}

        rebound = Engine(a, **opts)
        new = {name: t.clone() for name, t in kernel_tensors(Engine(b, **{**opts, "enable_cuda_graph": False}).model).items()}
        for name, p in rebound.model.named_parameters():
            if name in new:
                p.data = new[name]  # the bug
        rows = {"rebind": compare(rebound, "param.data = new_tensor for every parameter")}
        del rebound, new

        in_place = Engine(a, **opts)
        update = in_place.update_weights_from_disk(b)
        rows["in_place"] = compare(in_place, "engine.update_weights_from_disk (copies into the same memory)")
        rows["in_place"]["update_ms"] = update["elapsed_ms"]
        timing = {"batch": len(PROMPTS), "eager_ms_per_step": time_step(in_place, True, steps)}
        if gpu:
            timing["graph_ms_per_step"] = time_step(in_place, False, steps)
            timing["eager_over_graph"] = timing["eager_ms_per_step"] / timing["graph_ms_per_step"]
    hardware = torch.cuda.get_device_name() if gpu else "cpu"
    return {"benchmark": "graphs", "date": date.today().isoformat(), "hardware": hardware,
            "torch": torch.__version__, "device": device, "cuda_graphs": gpu,
            "config": {k: getattr(config, k) for k in SHAPE}, "prompts": PROMPTS, **rows, "timing": timing}


def report(r: dict) -> None:
    print(f"\nCUDA graphs and hot updates, {r['hardware']}, torch {r['torch']}, {r['date']}")
    for key in ("rebind", "in_place"):
        row = r[key]
        print(f"  {key:<9} graph replay max |logit - cold| {row['graph_max_abs_diff_vs_cold']:.4g}; "
              f"eager {row['eager_max_abs_diff_vs_cold']:.4g}; greedy == cold: {row['greedy_equals_cold']}; "
              f"audit: {row['audit'][:90]}")
    t = r["timing"]
    if "graph_ms_per_step" in t:
        print(f"  decode step, batch {t['batch']}: graph {t['graph_ms_per_step']:.3f} ms, "
              f"eager {t['eager_ms_per_step']:.3f} ms ({t['eager_over_graph']:.1f}x)")


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(prog="python -m course_lib.bench graphs")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--json", default=None, help="write the results here (GPU only)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("graphs: needs CUDA (CUDA graphs exist only on a GPU); nothing measured, no file written")
        return None
    result = measure("cuda", args.steps)
    report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
