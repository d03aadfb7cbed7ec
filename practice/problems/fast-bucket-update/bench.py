"""Timing for fast-bucket-update, shared by its speed cases and by
``python practice/judge.py bench fast-bucket-update``.

The workload is a model with many small tensors, where the work around each copy, not
the copies, decides the speed: an engine started with random weights, and the buckets
of new weights already in device memory, as an IPC hand-over leaves them. Only the
updater's ``apply`` over all buckets is timed. Every figure is the best of several
rounds, and the updaters take turns round by round, so a busy machine slows all of them
alike; a ratio between two of them measured in the same run is what the cases grade.

What keeps the figure honest: before every timed round new values are written into the
same bucket buffers (a sender reuses its buffers), so an updater that skips a buffer it
has seen before applies nothing; after every round of yours, untimed, the model is
checked to hold exactly the bytes of that round; and a figure above one flat copy of the
same bytes on the same device is refused as impossible. Speed is graded only on a GPU:
on a CPU the per-tensor costs this problem is about are a different story, so there
``bench`` reports the figures and says the speed is not graded.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from course_lib import Engine
from course_lib.bench import run_header
from course_lib.bench.update import sync
from course_lib.weights.transports import bucket
from course_lib.weights.checkpoint import preset, random_state_dict
from course_lib.weights.commit.copy_plan import checkpoint_view
from course_lib.weights.transports.ipc import group_into_buckets

FRACTION = 0.5  # the speed cases ask for at least this share of the reference's bytes/s
NOT_GRADED = 3  # bench's exit code where the speed is not graded (not a GPU)

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


def refill(work: Workload, generator: torch.Generator) -> None:
    """New values in every bucket, written into the same buffers (a sender reuses its
    buffers): an updater that skips a buffer it has seen before applies nothing new."""
    for b in work.buckets:
        flat, metadata = b["flattened_tensor"], b["metadata"]
        dtypes = {m.dtype for m in metadata}
        if len(dtypes) == 1:  # one dtype (the workload's): one fill; offsets are aligned to it
            dtype = dtypes.pop()
            end = metadata[-1].end_idx
            flat[:end - end % dtype.itemsize].view(dtype).normal_(generator=generator)
        else:
            for m in metadata:
                flat[m.start_idx:m.end_idx].view(m.dtype).normal_(generator=generator)


def not_landed(work: Workload) -> str | None:
    """None when the model holds every tensor of the buckets as they are now; else which one does not."""
    model = work.engine.model
    for b in work.buckets:
        flat = b["flattened_tensor"]
        for m in b["metadata"]:
            dest = checkpoint_view(model, m.name)
            if dest is None:
                continue  # a tied lm_head: the embedding holds it
            src = flat[m.start_idx:m.end_idx].view(m.dtype).view(m.shape)
            if not torch.equal(dest, src.to(dest.dtype)):
                return m.name
    return None


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

    def refill(self, generator: torch.Generator) -> None:
        self.src.random_(generator=generator)  # new bytes each round, as the updaters get

    def run(self) -> None:
        self.dst.copy_(self.src)


def best_seconds(runs: dict[str, tuple], device: str, rounds: int) -> dict[str, float]:
    """Best wall time of each run over ``rounds`` rounds, taking turns; one untimed warm-up.

    ``runs``: label -> (prepare, run, check); ``prepare`` (untimed) writes the round's new
    bytes, ``check`` (untimed, may be None) raises when the round's bytes did not land."""
    for prepare, run, check in runs.values():
        prepare()
        run()
    best = dict.fromkeys(runs, float("inf"))
    for r in range(rounds):
        for label, (prepare, run, check) in runs.items():
            prepare()
            sync(device)
            start = time.perf_counter()
            run()
            sync(device)
            best[label] = min(best[label], time.perf_counter() - start)
            if check is not None:
                check(r)
    return best


class NotApplied(AssertionError):
    """A timed round whose bytes are not in the model afterwards: the figure measures nothing."""


def measure(candidate, reference=None, device: str = "cpu", rounds: int | None = None, work: Workload | None = None,
            progress=None) -> dict:
    """GB/s of ``candidate.BucketUpdater`` beside the reference's (when given), the
    engine's general loaders and one flat device copy of the same bytes.

    Raises ``NotApplied`` when a timed round of the candidate left the model without that
    round's bytes (a skipped or partial update)."""
    work = work or workload(device)
    rounds = rounds or WORKLOADS[torch.device(device).type]["rounds"]
    model = work.engine.model
    gen = torch.Generator(device=work.device).manual_seed(int.from_bytes(os.urandom(4), "little"))
    fresh = lambda: refill(work, gen)  # noqa: E731

    def applying(updater):
        return lambda: [updater.apply(b) for b in work.buckets]

    def landed(r):
        name = not_landed(work)
        if name is not None:
            raise NotApplied(f"after timed round {r + 1} the model does not hold that round's new bytes (first "
                             f"differing tensor: {name}): every round must apply every bucket, even a buffer "
                             f"seen before")

    flat = FlatCopy(work.nbytes, work.device)
    runs = {"yours": (fresh, applying(candidate.BucketUpdater(model)), landed)}
    if reference is not None:
        runs["reference"] = (fresh, applying(reference.BucketUpdater(model)), None)
    runs["engine loaders"] = (fresh, applying(EngineLoaders(model)), None)
    runs["one flat copy"] = (lambda: flat.refill(gen), flat.run, None)
    if progress:
        progress(f"timing {', '.join(runs)} on {device}: {work.num_tensors} tensors, {work.nbytes / 1e6:.1f} MB "
                 f"in {len(work.buckets)} buckets, best of {rounds} rounds, new bytes every round")
    seconds = best_seconds(runs, work.device, rounds)
    gbps = {label: work.nbytes / s / 1e9 for label, s in seconds.items()}
    graded = torch.device(device).type == "cuda"
    result = {**run_header("fast-bucket-update", device), "tensors": work.num_tensors, "bytes": work.nbytes,
              "buckets": len(work.buckets), "rounds": rounds, "seconds": seconds, "GB/s": gbps,
              "yours / one flat copy": gbps["yours"] / gbps["one flat copy"],
              "yours / engine loaders": gbps["yours"] / gbps["engine loaders"], "required fraction": FRACTION,
              "graded": graded}
    # Nothing moves these bytes faster than one copy of them on this device.
    result["impossible"] = result["yours / one flat copy"] > 1.0
    if reference is not None:
        result["yours / reference"] = gbps["yours"] / gbps["reference"]
        if graded:  # a verdict only where speed is graded; elsewhere the figures alone
            result["fast enough"] = result["yours / reference"] >= FRACTION and not result["impossible"]
    return result


def load_module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report(result: dict) -> str:
    lines = [f"{result['tensors']} tensors, {result['bytes'] / 1e6:.1f} MB in {result['buckets']} buckets on "
             f"{result['device']}; best of {result['rounds']} rounds, new bytes every round"]
    for label, gbps in result["GB/s"].items():
        lines.append(f"  {label:<15} {gbps:8.2f} GB/s  ({1e3 * result['seconds'][label]:.2f} ms)")
    lines.append(f"yours / one flat copy: {result['yours / one flat copy']:.0%} (the hardware's limit)")
    if result["impossible"]:
        lines.append("REFUSED: faster than one flat copy of the same bytes on this device, which is impossible")
    if "yours / reference" in result:
        lines.append(f"yours / reference: {result['yours / reference']:.0%} (at least {FRACTION:.0%} asked)")
    else:
        lines.append("reference: not present in this edition (hidden tests absent); "
                     f"yours / engine loaders: {result['yours / engine loaders']:.0%}")
    if not result["graded"]:
        lines.append(f"speed: not graded on {result['device']} (graded on a GPU only, where the per-tensor "
                     f"costs this problem is about decide the speed)")
    elif "fast enough" in result:
        lines.append("speed: " + ("fast enough" if result["fast enough"] else "NOT fast enough"))
    return "\n".join(lines)


def verdict_code(result: dict) -> int:
    """0 fast enough, 1 too slow or impossible, NOT_GRADED where speed is not graded (not a GPU)."""
    if result["impossible"]:
        return 1
    if not result["graded"]:
        return NOT_GRADED
    return 0 if result.get("fast enough", True) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="time a BucketUpdater against the reference and the device's copy limit")
    ap.add_argument("--candidate", required=True)
    ap.add_argument("--reference")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    # exit codes: 0 fast enough, 1 too slow or refused, 3 speed not graded here (no GPU)
    candidate = load_module(args.candidate, "candidate")
    reference = load_module(args.reference, "reference") if args.reference else None
    try:
        result = measure(candidate, reference, args.device, args.rounds, progress=None if args.json else print)
    except NotApplied as exc:
        print(json.dumps({"not applied": str(exc)}) if args.json else f"REFUSED: {exc}")
        return 1
    print(json.dumps(result, indent=1) if args.json else report(result))
    return verdict_code(result)


if __name__ == "__main__":
    sys.exit(main())
