"""One engine rank of a ``TPEngine`` in its own process: how it joins, obeys and leaves.

A worker builds the same ``Engine`` as rank 0 with its own ``tp_rank`` and device, joins
the default process group, then obeys rank 0's commands: a forward pass (``run``, with
the batch rank 0 scheduled), the prompt-logits oracle's forward, an engine method call
(``call``: an update, a snapshot, a group to join), or its parameters for a test. Every
rank leaves the group together (``leave_group``), its CUDA graphs released first.
"""
from __future__ import annotations

import dataclasses
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from course_lib.config import EngineConfig, is_cuda
from course_lib.engine.engine import Engine
from course_lib.update.records import Snapshot


@dataclass
class SeqView:
    """What a worker's ModelRunner reads of a sequence to build the same batch."""

    token_ids: list[int]
    num_tokens: int
    num_cached_tokens: int
    block_table: list[int]

    @classmethod
    def of(cls, seq) -> "SeqView":
        return cls(list(seq.token_ids), seq.num_tokens, seq.num_cached_tokens, list(seq.block_table))


def share_cpu_tensors(obj) -> None:
    """Move every CPU tensor in ``obj`` (nested lists, tuples and dicts) into shared memory
    now, in this thread, as pickling it for another process would do later."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu" and not obj.is_shared():
            obj.share_memory_()
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            share_cpu_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            share_cpu_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # an update source, a decoded payload
        for f in dataclasses.fields(obj):
            share_cpu_tensors(getattr(obj, f.name))

class WorkerError(RuntimeError):
    """A worker rank failed; the message carries its traceback."""


def _device_for(device: str, rank: int) -> str:
    return f"cuda:{rank}" if is_cuda(device) else device


def _init_group(rank: int, world_size: int, store, device: str, timeout_s: float) -> None:
    cuda = is_cuda(device)
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s),
                            device_id=torch.device(f"cuda:{rank}") if cuda else None)


def _worker_store(port: int, world_size: int, rank: int, timeout_s: float):
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
    store.set(f"joined/{rank}", "1")  # rank 0 waits for this while watching that we are alive
    return store


def _summary(result):
    """What a worker sends back: plain values only (never a snapshot's tensors)."""
    if isinstance(result, Snapshot):
        return {"weight_version": result.weight_version}
    if isinstance(result, dict):
        return {k: v for k, v in result.items() if not isinstance(v, (dict, torch.Tensor)) or k == "timings_ms"}
    return result if isinstance(result, (type(None), bool, int, float, str)) else None


def worker_main(rank: int, world_size: int, port: int, model_path: str, config: EngineConfig,
                cpu_threads: int | None, commands, replies, timeout_s: float) -> None:
    """A worker rank: build its shard of the engine (rank 0's config, its own rank and
    device), then obey rank 0's commands."""
    try:
        config = replace(config, device=_device_for(config.device, rank), tp_rank=rank)
        if cpu_threads:
            torch.set_num_threads(cpu_threads)
        _init_group(rank, world_size, _worker_store(port, world_size, rank, timeout_s), config.device, timeout_s)
        engine = Engine(model_path, config=config)
        replies.put((rank, "ok", None))
    except BaseException:
        replies.put((rank, "error", traceback.format_exc()))
        return
    runner = engine.model_runner
    while True:
        cmd = commands.get()
        kind = cmd[0]
        if kind == "stop":
            break
        try:
            if kind == "run":            # one step's forward; rank 0 samples
                runner.forward_logits(cmd[1], cmd[2])
                continue
            if kind == "prefill_all":    # the prompt-logits oracle's forward
                runner.prefill_all_logits(cmd[1])
                continue
            if kind == "call":           # an engine method, e.g. update_weights_from_disk
                _, name, args, kwargs = cmd
                replies.put((rank, "ok", _summary(getattr(engine, name)(*args, **kwargs))))
            elif kind == "parameters":
                replies.put((rank, "ok", {k: v.detach().cpu().clone() for k, v in engine.model.state_dict().items()}))
        except BaseException as exc:
            # A failed forward leaves rank 0 inside a collective; it times out there.
            replies.put((rank, "error", (type(exc).__name__, traceback.format_exc())))
    leave_group(engine)


def leave_group(engine) -> None:
    """Leave the default process group: first the CUDA graphs, which captured its
    collectives (``ModelRunner.release_graphs``), then the group itself. Every rank does
    this at once: under NCCL, tearing a communicator down takes all of them."""
    if engine is not None:
        engine.model_runner.release_graphs()
    dist.destroy_process_group()
