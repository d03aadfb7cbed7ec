"""Does leaving an NCCL process group hang after CUDA graphs captured its collectives?

The question behind ``TPEngine.close``: each rank captures decode graphs holding NCCL
all-reduces, then leaves the group. This probe runs that shape alone, on every visible
GPU (one rank each; a group of one on a one-GPU machine), twice: leaving with the graphs
still alive, and after ``graph.reset()`` (what ``ModelRunner.release_graphs`` does). Each
case runs in fresh processes with a limit, and prints how it ended and how long it took.

    python scripts/nccl_graph_teardown.py [--timeout 60]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from course_lib.weights.transports.dist import free_port


def rank_main(rank: int, world: int, port: int, release: bool, done) -> None:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=torch.device(f"cuda:{rank}"))
    x = torch.ones(1 << 20, device="cuda")
    for _ in range(3):  # warm-up outside the graph, as the engine's capture does
        dist.all_reduce(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.mul_(0.5)  # a kernel of its own: in a group of one, NCCL's all-reduce captures nothing
        dist.all_reduce(x)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if release:
        graph.reset()
        torch.cuda.synchronize()
    dist.destroy_process_group()
    done.put((rank, time.perf_counter() - t0))


def case(release: bool, timeout: float) -> str:
    ctx = mp.get_context("spawn")
    world = torch.cuda.device_count()
    port = free_port()
    done = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, release, done)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    times = {}
    while not done.empty():
        r, s = done.get()
        times[r] = s
    how = "graphs released first" if release else "graphs alive"
    if hung:
        return f"{how}: HUNG (ranks {hung} still in destroy_process_group after {timeout:.0f} s)"
    codes = [p.exitcode for p in procs]
    left = ", ".join(f"rank {r} {times[r] * 1e3:.0f} ms" for r in sorted(times))
    return f"{how}: left the group ({left}), exit codes {codes}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args()
    print(f"torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, {torch.cuda.device_count()} GPU(s): "
          f"{torch.cuda.get_device_name(0)}")
    for release in (False, True):
        print(case(release, args.timeout), flush=True)


if __name__ == "__main__":
    main()
