"""Tensor parallelism: one engine spread over several processes, each holding a shard.

``TPEngine(path, tensor_parallel_size=2)`` is an ``Engine`` (rank 0, in the calling
process) plus one spawned worker process per extra rank. Every rank builds the same
``Engine`` with its own ``tp_rank``: its model holds that rank's slices (the loaders cut
them), its KV pool holds its share of the KV heads. The ranks join one default
``torch.distributed`` process group (gloo on CPU, NCCL on GPUs, on a free loopback
port), which the sharded layers all-reduce and all-gather over.

Rank 0 alone schedules and samples. Before each forward pass it sends the batch (token
ids, positions in the cache, block tables) to the workers, and every rank runs the same
forward, meeting in the same collectives; the workers throw away the logits. On GPU each
rank captures its own CUDA graphs, collectives included.

Weight updates go to every rank through one call, ``update(source, options)``: each rank
loads the same checkpoint tensors through its own loaders, which slice them (from disk,
from tensors, or from a trainer's broadcast that every rank receives in full, as SGLang's
ranks do; ``update_weights_resharded`` instead sends each rank only its pieces). Rank 0
checks the pause rules first (only it has requests), drains ``wait`` mode before anything
changes, then the ranks apply in parallel. Ranks that disagree (one applied, one failed)
leave the engine marked unhealthy. The worker's side is ``tp_worker.py``.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from course_lib.config import EngineConfig, is_cuda
from course_lib.engine.engine import Engine
from course_lib.engine.tp_worker import (SeqView, WorkerError, _device_for, _init_group, leave_group,
                                         share_cpu_tensors, worker_main)
from course_lib.update.one_call import asks_for_one_call, with_pause
from course_lib.update.records import UpdateOptions
from course_lib.update.sources import UpdateSource
from course_lib.update.updater import REFUSALS
from course_lib.weights.checkpoint import CheckpointReader
from course_lib.weights.commit.validate import UpdateError
from course_lib.weights.transports.trainer import wait_for_exit

CTX = mp.get_context("spawn")  # forked children hang on torch's thread pools (and CUDA)


def check_divisible(config, tp_size: int) -> None:
    """Each rank must get whole heads, whole KV heads and equal vocabulary and MLP slices."""
    for what, n in (("num_attention_heads", config.num_attention_heads),
                    ("num_key_value_heads", config.num_key_value_heads),
                    ("vocab_size", config.vocab_size), ("intermediate_size", config.intermediate_size)):
        if n % tp_size:
            raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({tp_size})")


class _BroadcastRunner:
    """Rank 0's ModelRunner, which first sends each forward's batch to the workers."""

    def __init__(self, runner, commands: list):
        self._runner, self._commands = runner, commands

    def _send(self, *cmd) -> None:
        for q in self._commands:
            q.put(cmd)

    def forward_logits(self, seqs, is_prefill: bool):
        self._send("run", [SeqView.of(s) for s in seqs], is_prefill)
        return self._runner.forward_logits(seqs, is_prefill)

    def run(self, seqs, is_prefill: bool):
        from course_lib.layers.sampler import sample_batch
        return sample_batch(self.forward_logits(seqs, is_prefill), seqs)

    def prefill_all_logits(self, seq):
        self._send("prefill_all", SeqView.of(seq))
        return self._runner.prefill_all_logits(seq)

    def __getattr__(self, name):  # kv_cache, graph_outputs, ...: rank 0's own
        return getattr(self._runner, name)


class TPEngine(Engine):
    """An ``Engine`` over ``tensor_parallel_size`` ranks (rank 0 here, the rest spawned).

    Use it as a context manager, or call ``close()``: the workers hold a process group
    that must be torn down. One TPEngine per process at a time (it owns the process's
    default group)."""

    def __init__(self, model_path, tensor_parallel_size: int = 2, device: str = "cpu",
                 timeout_s: float = 120.0, cpu_threads: int | None = None, **options):
        """``options``: ``Engine``'s keyword options (every rank gets the same)."""
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {tensor_parallel_size}")
        if is_cuda(device) and torch.cuda.device_count() < tensor_parallel_size:
            raise RuntimeError(f"tensor_parallel_size={tensor_parallel_size} needs as many GPUs; "
                               f"torch sees {torch.cuda.device_count()}")
        # Fail here, before any process starts, on what would fail on every rank: a bad
        # checkpoint dir, or heads / vocabulary that tensor_parallel_size does not divide.
        model_config = CheckpointReader(model_path).config
        check_divisible(model_config, tensor_parallel_size)
        config = EngineConfig(device=device, tp_size=tensor_parallel_size, **options).resolved(model_config)
        if dist.is_initialized():
            raise RuntimeError("this process already has a default process group (another TPEngine?); "
                               "close it first")
        self.tp_size = tensor_parallel_size
        self.timeout_s = timeout_s
        self._commands, self._workers, self._replies = [], [], CTX.Queue()
        self._closed = False
        # On CPU the ranks share the cores: each gets its share of threads. Oversubscribed,
        # OpenMP threads spin while they wait for one another and every collective stalls
        # (measured on 2 busy cores: 0.4 s per decode step with 2 threads per rank, 10-40 ms with 1).
        self._saved_threads = torch.get_num_threads()
        if not config.is_cuda:
            cpu_threads = cpu_threads or max(1, len(os.sched_getaffinity(0)) // tensor_parallel_size)
            torch.set_num_threads(cpu_threads)
        try:
            self._start_workers(str(model_path), config, cpu_threads)
            super().__init__(model_path, config=replace(config, device=_device_for(device, 0)))
            failed = [(r + 1, v) for r, (status, v) in enumerate(self._gather("start")) if status != "ok"]
            if failed:
                raise WorkerError(f"rank {failed[0][0]} failed to start:\n{failed[0][1]}")
        except BaseException:
            self.close()
            raise
        self.model_runner = _BroadcastRunner(self.model_runner, self._commands)

    def _start_workers(self, model_path: str, config: EngineConfig, cpu_threads: int | None) -> None:
        """Spawn ranks 1.. and join the default process group with them as rank 0."""
        # Rank 0 hosts the rendezvous store on a port the OS picks (no race for a "free" one).
        store = dist.TCPStore("127.0.0.1", 0, self.tp_size, is_master=True,
                              timeout=timedelta(seconds=self.timeout_s), wait_for_workers=False)
        for rank in range(1, self.tp_size):
            commands = CTX.Queue()
            proc = CTX.Process(target=worker_main, args=(rank, self.tp_size, store.port, model_path, config,
                                                          cpu_threads, commands, self._replies, self.timeout_s),
                               daemon=True)
            proc.start()
            self._commands.append(commands)
            self._workers.append(proc)
        self._wait_for_workers_to_join(store)
        _init_group(0, self.tp_size, store, _device_for(config.device, 0), self.timeout_s)

    # ---- talking to the workers ----------------------------------------------------------
    def _wait_for_workers_to_join(self, store) -> None:
        """Wait for each worker to reach the store, failing fast if one dies first (a
        blocking rendezvous would wait out the whole timeout for a dead rank)."""
        deadline = time.monotonic() + self.timeout_s
        for rank, proc in enumerate(self._workers, start=1):
            while not store.check([f"joined/{rank}"]):
                if proc.exitcode is not None:
                    try:
                        _, _, detail = self._replies.get(timeout=5.0)
                    except queue.Empty:
                        detail = f"exit code {proc.exitcode}"
                    raise WorkerError(f"rank {rank} failed to start:\n{detail}")
                if time.monotonic() > deadline:
                    raise WorkerError(f"rank {rank} did not join within {self.timeout_s} s")
                time.sleep(0.01)

    def _gather(self, what: str) -> list:
        """One (status, value) reply from every worker, in rank order; raises if one is silent."""
        got: dict[int, tuple] = {}
        while len(got) < len(self._workers):
            try:
                rank, status, value = self._replies.get(timeout=self.timeout_s)
            except queue.Empty:
                silent = sorted(set(range(1, self.tp_size)) - set(got))
                raise WorkerError(f"{what}: no reply from ranks {silent} within {self.timeout_s} s") from None
            got[rank] = (status, value)
        return [got[r] for r in sorted(got)]

    def _send(self, *cmd) -> None:
        # A queue pickles in a background thread, and pickling a CPU tensor moves its storage
        # into shared memory, freeing the old memory under anyone reading it meanwhile: rank
        # 0's own update reads these very tensors then (and read garbage). Move them first.
        share_cpu_tensors(cmd)
        for q in self._commands:
            q.put(cmd)

    def _on_every_rank(self, send: tuple, local, what: str):
        """Send ``send`` to the workers, run ``local()`` here meanwhile, collect every
        reply, and reconcile: all succeeded, all failed, or (the bad case) a mix."""
        self._send(*send)
        error = None
        try:
            result = local()
        except BaseException as exc:
            error = exc
        replies = self._gather(what)
        failed = [(r + 1, v) for r, (status, v) in enumerate(replies) if status == "error"]
        if error is None and not failed:
            return result
        if error is not None and len(failed) == len(replies):
            raise error  # every rank refused: nothing changed anywhere
        if failed and error is None:
            rank, (kind, tb) = failed[0]
            message = f"{what} failed on rank {rank} ({kind}) but succeeded on rank 0"
        else:
            message = f"{what} failed on rank 0 ({error}) but succeeded on some workers"
        self.updater.unhealthy = f"{message}: the ranks are no longer in the same state"
        detail = failed[0][1][1] if failed else ""
        raise UpdateError(f"{self.unhealthy}\n{detail}") from error

    def _call_everywhere(self, name: str, *args, **kwargs):
        local = getattr(super(), name)
        return self._on_every_rank(("call", name, args, kwargs), lambda: local(*args, **kwargs), name)

    # ---- every rank ------------------------------------------------------------------------
    def update(self, source: UpdateSource, options: UpdateOptions | None = None) -> dict:
        """Every rank runs the same update (each through its own loaders). Rank 0 owns the
        requests: it refuses or drains first, before any rank writes, so no worker runs a
        forward pass with new weights while rank 0 still has old ones. A refusal there is
        every rank's: where a sender is already pushing bytes to every rank (a broadcast,
        resharded pieces), every rank still takes them (``refuse_with``) and refuses too,
        so nothing changes anywhere and no sender hangs; the original refusal is raised."""
        options = options or UpdateOptions()
        if asks_for_one_call(options):  # the pause and the continue are rank 0's (it has the requests)
            plain = replace(options, pause_mode=None, resume=None)
            return with_pause(self.pause, self.continue_generation, lambda: self.update(source, plain), options,
                              lambda: self.unhealthy is None)
        try:
            self.pause.refuse_if_busy(options.abort_all_requests)
            if self.pause.paused and self.pause.pause_mode == "wait":
                self.pause.drain(options.wait_timeout_s, self.pause.stats[-1])
        except REFUSALS as refusal:
            if type(source).refused is not UpdateSource.refused:  # a sender is pushing to every rank
                try:
                    self._call_everywhere("update", source, replace(options, refuse_with=str(refusal)))
                except UpdateError:
                    pass  # every rank refused, as asked: the original refusal says why
            raise
        return self._call_everywhere("update", source, options)

    def take_snapshot(self) -> dict:
        return self._call_everywhere("take_snapshot")

    def verify_addresses_on_every_rank(self) -> None:
        """The address audit on every rank (``verify_addresses`` checks rank 0 alone: each
        rank's update already audits itself, and rank 0's runs in the middle of one)."""
        self._call_everywhere("verify_addresses")

    def init_weights_update_group(self, *args, **kwargs) -> dict:
        """Every rank joins, as group rank ``rank_offset + tp_rank``."""
        return self._call_everywhere("init_weights_update_group", *args, **kwargs)

    def destroy_weights_update_group(self, *args, **kwargs) -> dict:
        return self._call_everywhere("destroy_weights_update_group", *args, **kwargs)

    # ---- inspection and shutdown -----------------------------------------------------------
    def rank_parameters(self, rank: int) -> dict[str, torch.Tensor]:
        """Rank ``rank``'s parameters (a CPU copy), to compare a hot rank with a cold one."""
        if rank == 0:
            return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        if not 0 < rank < self.tp_size:
            raise ValueError(f"rank {rank} outside tensor_parallel_size {self.tp_size}")
        self._commands[rank - 1].put(("parameters",))
        rank_got, status, value = self._replies.get(timeout=self.timeout_s)
        if status != "ok" or rank_got != rank:
            raise WorkerError(f"rank {rank} could not report its parameters: {value}")
        return value

    def close(self) -> list[int]:
        """Stop the workers and leave the process group; returns the workers' exit codes."""
        if self._closed:
            return [p.exitcode for p in self._workers]
        self._closed = True
        for q in self._commands:
            q.put(("stop",))
        # Leave the group while the workers leave theirs. Under NCCL tearing a communicator
        # down takes every rank: a rank 0 that first waited for the workers to exit would
        # wait on workers that wait on it (each worker leaves the group before it exits).
        # The teardown runs on a thread with a limit, so a dead or hung worker can never
        # hang close(); the group is then left as it is (the process is ending anyway).
        left, error = self._leave_group(timeout_s=60.0) if dist.is_initialized() else (True, None)
        codes = []
        for proc in self._workers:
            try:
                codes.append(wait_for_exit(proc, timeout=60.0))
            except TimeoutError:
                proc.kill()
                codes.append(wait_for_exit(proc, timeout=10.0))
        torch.set_num_threads(self._saved_threads)
        if error is not None:  # raised only now: the workers have been waited for first
            raise error
        if not left:
            raise WorkerError("rank 0 could not leave the process group within 60 s (a worker did not take "
                              f"part; worker exit codes {codes})")
        return codes

    def _leave_group(self, timeout_s: float) -> tuple[bool, BaseException | None]:
        """``destroy_process_group`` on a thread, waited for at most ``timeout_s``: whether
        it ended, and what it raised."""
        errors: list[BaseException] = []

        runner = getattr(self, "model_runner", None)  # absent if __init__ failed before building it
        engine = self if runner is not None else None

        def leave():
            try:
                leave_group(engine)
            except BaseException as exc:  # noqa: BLE001 - reported below, on the caller's thread
                errors.append(exc)

        t = threading.Thread(target=leave, name="tp-leave-group", daemon=True)
        t.start()
        t.join(timeout_s)
        return not t.is_alive(), (errors[0] if errors else None)

    def __enter__(self) -> "TPEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
