"""Time the hot disk update (layer by layer, page-cached) for several reader settings, same run.

    python scripts/disk_update_sweep.py --preset qwen3-8b --threads 8 16 --chunk-mb 32 64 128

Each setting: one warm-up update (fills the page cache, allocates the pinned ring and
the rollback slabs), then the median of ``--repeat`` timed updates alternating two
checkpoints. Prints GB/s, the ratio to pinned host-to-device, the phases and the extra
GPU memory against the largest layer. ``--device cpu`` runs it (slowly) without a GPU.

``--probes`` (GPU) first measures what bounds the stream, same run: the host's own
memory copy (pinned to pinned, torch's threads), the reader alone (page cache -> pinned
ring -> GPU, tensors dropped), and the page cache copied to the GPU with no host copy at
all (the file memory-mapped, its pages registered with ``cudaHostRegister`` read-only,
then one host-to-device copy), registration time included and apart.
"""
import argparse
import mmap
import os
import statistics
import tempfile
import time

import torch

from course_lib import Engine
from course_lib.bench.update import median_time
from course_lib.weights.checkpoint import pinned_reader
from course_lib.weights.checkpoint import CheckpointReader, make_random
from course_lib.weights.commit.layerwise import layer_key


def pinned_h2d_gbps(nbytes: int) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return nbytes / (time.perf_counter() - t0) / 1e9


def timed(fn) -> float:
    """Seconds of one call, the GPU synchronized before and after."""
    return median_time(fn, "cuda", repeat=1, warmup=0)


def probes(path, nbytes: int) -> None:
    """What bounds the disk stream on this host (see the module docstring)."""
    size = min(nbytes, 4 << 30)
    a, b = (torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    a.fill_(1)
    b.copy_(a)
    print(f"  host memcpy, pinned to pinned ({torch.get_num_threads()} threads): "
          f"{size / timed(lambda: b.copy_(a)) / 1e9:.1f} GB/s")
    del a, b
    reader = CheckpointReader(path)

    def read_all():
        for _, t in reader.iter_tensors(device="cuda"):
            del t
    read_all()  # page cache warm, ring allocated
    print(f"  reader alone (page cache -> pinned ring -> GPU): {nbytes / timed(read_all) / 1e9:.1f} GB/s")
    cudart = torch.cuda.cudart()
    for file in sorted({str(f) for f in reader._unique_files()})[:1]:
        n = os.path.getsize(file)
        with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            host = torch.frombuffer(memoryview(m), dtype=torch.uint8)  # read-only pages of the page cache
            dev = torch.empty(n, dtype=torch.uint8, device="cuda")
            t0 = time.perf_counter()
            err = cudart.cudaHostRegister(host.data_ptr(), n, 8)  # 8: cudaHostRegisterReadOnly
            reg = time.perf_counter() - t0
            if int(err) != 0:
                print(f"  cudaHostRegister of the mapped file failed: {err}")
                continue
            copy = timed(lambda: dev.copy_(host, non_blocking=True))
            t0 = time.perf_counter()
            cudart.cudaHostUnregister(host.data_ptr())
            unreg = time.perf_counter() - t0
            print(f"  page cache registered, one copy ({n / 1e9:.2f} GB file): register {reg * 1e3:.0f} ms, "
                  f"copy {n / copy / 1e9:.1f} GB/s, unregister {unreg * 1e3:.0f} ms; "
                  f"all three: {n / (reg + copy + unreg) / 1e9:.1f} GB/s")
            del host, dev


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-1.7b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, nargs="+", default=[pinned_reader.READ_THREADS])
    p.add_argument("--chunk-mb", type=int, nargs="+", default=[pinned_reader.CHUNK_BYTES >> 20])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--ring", type=int, nargs="+", default=[pinned_reader.RING_BUFFERS])
    p.add_argument("--probes", action="store_true", help="measure the host's limits first (GPU)")
    p.add_argument("--rollback", choices=["on", "off", "both"], default="on",
                   help="off: take a snapshot first (keep_snapshot=True), so the streamed update saves no "
                        "rollback copies; shows what the rollback's device-to-host traffic costs")
    args = p.parse_args()
    gpu = args.device.startswith("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        paths = [make_random(f"{tmp}/{k}", args.preset, seed=k, device=args.device if gpu else "cpu") for k in (1, 2)]
        meta = CheckpointReader(paths[0]).metadata()
        nbytes = sum(torch.Size(s).numel() * d.itemsize for s, d in meta.values())
        layers = {}
        for name, (s, d) in meta.items():
            layers[layer_key(name)] = layers.get(layer_key(name), 0) + torch.Size(s).numel() * d.itemsize
        h2d = pinned_h2d_gbps(min(nbytes, 4 << 30)) if gpu else None
        print(f"{args.preset}: {nbytes / 1e9:.2f} GB, largest layer {max(layers.values()) / 1e9:.3f} GB"
              + (f", pinned H2D {h2d:.1f} GB/s" if h2d else ""))
        if args.probes and gpu:
            probes(paths[1], nbytes)
        engine = Engine(paths[0], device=args.device, max_num_seqs=8, max_model_len=512)
        settings = [(t, c, g, r) for t in args.threads for c in args.chunk_mb for g in args.ring
                    for r in ((True, False) if args.rollback == "both" else (args.rollback == "on",))]
        for threads, chunk, ring, rollback in settings:
            pinned_reader.READ_THREADS, pinned_reader.CHUNK_BYTES, pinned_reader.RING_BUFFERS = threads, chunk << 20, ring
            engine.update_weights_from_disk(paths[1])  # warm-up
            times, last = [], None
            for k in range(args.repeat):
                t0 = time.perf_counter()
                last = engine.update_weights_from_disk(paths[k % 2], keep_snapshot=not rollback)
                times.append(time.perf_counter() - t0)
            gbps = nbytes / statistics.median(times) / 1e9
            extra = last["memory"].get("gpu_peak_extra_bytes", 0)
            ratio = f" = {gbps / h2d:4.0%} of pinned H2D" if h2d else ""
            phases = ", ".join(f"{k} {v:.0f}" for k, v in last["timings_ms"].items())
            if not rollback:  # the snapshot is taken before the stream: time the stream alone
                gbps = nbytes / (sum(v for k, v in last["timings_ms"].items() if k != "snapshot") / 1e3) / 1e9
                ratio = f" = {gbps / h2d:4.0%} of pinned H2D" if h2d else ""
            print(f"threads {threads:2d}, chunk {chunk:4d} MiB, ring {ring}, rollback {'on ' if rollback else 'off'}: "
                  f"{gbps:6.1f} GB/s{ratio}; "
                  f"extra GPU {extra / 1e9:.3f} GB ({extra / max(layers.values()):.2f}x largest layer); {phases} ms")


if __name__ == "__main__":
    main()
