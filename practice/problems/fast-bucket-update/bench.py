"""Timing for fast-bucket-update, shared by its speed cases and by
``python practice/judge.py bench fast-bucket-update``.

The workload is a model with many small tensors, where the work around each copy, not
the copies, decides the speed: an engine started with random weights, and the buckets
of new weights already in device memory, as an IPC hand-over leaves them. Only the
updater's ``apply`` over all buckets is timed. Every figure is the best of several
rounds, and the updaters take turns round by round, so a busy machine slows all of them
alike; a ratio between two of them measured in the same run is what the cases grade.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from course_lib import Engine
from course_lib.bench import run_header
from course_lib.bench.update import sync
from course_lib.weights import bucket
from course_lib.weights.checkpoint import preset, random_state_dict
from course_lib.weights.transports.ipc import group_into_buckets

FRACTION = 0.5  # the speed cases ask for at least this share of the reference's bytes/s

# Per device: the model's shape (many layers of small matrices), the bucket size, rounds.
WORKLOADS = {
    "cpu": dict(config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=24, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, torch_dtype="float32"),
                bucket_bytes=4 << 20, rounds=7),
    "cuda": dict(config=dict(vocab_size=32768, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                             num_attention_heads=16, num_key_value_heads=8, head_dim=64, torch_dtype="bfloat16"),
                 bucket_bytes=64 << 20, rounds=20),
}


@dataclass
class Workload:
    engine: Engine
    buckets: list[dict]
    nbytes: int
    num_tensors: int
    device: str


def workload(device: str = "cpu") -> Workload:
    spec = WORKLOADS[torch.device(device).type]
    config = preset("small", **spec["config"])
    folder = Path(tempfile.mkdtemp(prefix="fast-bucket-update-"))
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict()))
    # load_format="dummy": random weights from the config alone, nothing written to disk.
    engine = Engine(folder, device=device, load_format="dummy", num_kv_blocks=8, enable_cuda_graph=False)
    new = random_state_dict(config, seed=7, device=device)
    buckets = [bucket.pack(group) for group in group_into_buckets(new.items(), spec["bucket_bytes"])]
    nbytes = sum(t.numel() * t.element_size() for t in new.values())
    return Workload(engine, buckets, nbytes, len(new), device)


class EngineLoaders:
    """The baseline: the engine's general load path (name mapping and a loader call per tensor)."""

    def __init__(self, model):
        self.model = model

    def apply(self, b) -> int:
        pairs = bucket.unpack(b)
        self.model.load_weights(pairs)
        return sum(t.numel() * t.element_size() for _, t in pairs)


class FlatCopy:
    """The hardware's limit: the same number of bytes in one copy between two device buffers."""

    def __init__(self, nbytes: int, device: str):
        self.src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.dst = torch.empty_like(self.src)

    def run(self) -> None:
        self.dst.copy_(self.src)


def best_seconds(runs: dict[str, callable], device: str, rounds: int) -> dict[str, float]:
    """Best wall time of each callable over ``rounds`` rounds, taking turns; one untimed warm-up."""
    for run in runs.values():
        run()
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for label, run in runs.items():
            sync(device)
            start = time.perf_counter()
            run()
            sync(device)
            best[label] = min(best[label], time.perf_counter() - start)
    return best


def measure(candidate, reference=None, device: str = "cpu", rounds: int | None = None, work: Workload | None = None,
            progress=None) -> dict:
    """GB/s of ``candidate.BucketUpdater`` beside the reference's (when given), the
    engine's general loaders and one flat device copy of the same bytes."""
    work = work or workload(device)
    rounds = rounds or WORKLOADS[torch.device(device).type]["rounds"]
    model = work.engine.model

    def applying(updater):
        return lambda: [updater.apply(b) for b in work.buckets]

    runs = {"yours": applying(candidate.BucketUpdater(model))}
    if reference is not None:
        runs["reference"] = applying(reference.BucketUpdater(model))
    runs["engine loaders"] = applying(EngineLoaders(model))
    runs["one flat copy"] = FlatCopy(work.nbytes, work.device).run
    if progress:
        progress(f"timing {', '.join(runs)} on {device}: {work.num_tensors} tensors, {work.nbytes / 1e6:.1f} MB "
                 f"in {len(work.buckets)} buckets, best of {rounds} rounds")
    seconds = best_seconds(runs, work.device, rounds)
    gbps = {label: work.nbytes / s / 1e9 for label, s in seconds.items()}
    result = {**run_header("fast-bucket-update", device), "tensors": work.num_tensors, "bytes": work.nbytes, "buckets": len(work.buckets),
              "rounds": rounds, "seconds": seconds, "GB/s": gbps,
              "yours / one flat copy": gbps["yours"] / gbps["one flat copy"],
              "yours / engine loaders": gbps["yours"] / gbps["engine loaders"], "required fraction": FRACTION}
    if reference is not None:
        result["yours / reference"] = gbps["yours"] / gbps["reference"]
        result["fast enough"] = result["yours / reference"] >= FRACTION
    return result


def load_module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report(result: dict) -> str:
    lines = [f"{result['tensors']} tensors, {result['bytes'] / 1e6:.1f} MB in {result['buckets']} buckets on "
             f"{result['device']}; best of {result['rounds']} rounds"]
    for label, gbps in result["GB/s"].items():
        lines.append(f"  {label:<15} {gbps:8.2f} GB/s  ({1e3 * result['seconds'][label]:.2f} ms)")
    lines.append(f"yours / one flat copy: {result['yours / one flat copy']:.0%} (the hardware's limit)")
    if "yours / reference" in result:
        verdict = "fast enough" if result["fast enough"] else "NOT fast enough"
        lines.append(f"yours / reference: {result['yours / reference']:.0%} (at least {FRACTION:.0%} asked: {verdict})")
    else:
        lines.append("reference: not present in this edition (hidden tests absent); "
                     f"yours / engine loaders: {result['yours / engine loaders']:.0%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="time a BucketUpdater against the reference and the device's copy limit")
    ap.add_argument("--candidate", required=True)
    ap.add_argument("--reference")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    candidate = load_module(args.candidate, "candidate")
    reference = load_module(args.reference, "reference") if args.reference else None
    result = measure(candidate, reference, args.device, args.rounds, progress=None if args.json else print)
    print(json.dumps(result, indent=1) if args.json else report(result))
    return 0 if result.get("fast enough", True) else 1


if __name__ == "__main__":
    sys.exit(main())
