"""The engine: load a checkpoint, accept requests, and run ``step()`` = schedule -> run -> postprocess.

The public surface follows SGLang's offline Engine (``generate`` returns ``text``,
``output_ids`` and ``meta_info``) plus a step-level API (``add_request``, ``step``,
``has_unfinished_requests``) so that callers can pause and update between steps.
"""
from __future__ import annotations

import functools
import operator
import time

import torch

from course_lib.config import EngineConfig, ModelConfig
from course_lib.engine.block_manager import BlockManager
from course_lib.engine.model_runner import ModelRunner
from course_lib.engine.pause import EngineBusyError, EnginePausedError, PauseControl  # noqa: F401 (importable here)
from course_lib.engine.scheduler import Scheduler
from course_lib.engine.sequence import SamplingParams, Sequence
from course_lib.history import STEP_LOG_SIZE, History
from course_lib.tokenizer import ByteTokenizer
from course_lib.update.methods import with_update_methods
from course_lib.update.records import UpdateOptions
from course_lib.update.transfers import Transfers
from course_lib.update.updater import Updater
from course_lib.weights.checkpoint import CheckpointReader
from course_lib.weights.checkpoint.model_loader import dummy_model, load_model
from course_lib.weights.commit.audit import AddressAudit
from course_lib.weights.commit.copy_plan import CopyPlan, read_checkpoint_tensor
from course_lib.weights.transports import remote
from course_lib.weights.transports.dist import DEFAULT_BUCKET_BYTES
from course_lib.weights.transports.remote import WaitingForWeightsError


def delegate(part: str, func):
    """An engine method that calls ``func``'s namesake on the engine's ``part`` (a dotted
    attribute path), with ``func``'s signature and docstring: the contract is the part's."""
    get = operator.attrgetter(part)

    @functools.wraps(func)
    def method(self, *args, **kwargs):
        return getattr(get(self), func.__name__)(*args, **kwargs)
    return method


@with_update_methods
class Engine:
    """A hot-updatable inference engine for Qwen3-style checkpoints.

    The keyword options are ``EngineConfig``'s fields (see config.py); ``config=`` gives
    them all at once instead (the keyword options are then not read), e.g.
    ``Engine(path, config=other.config)`` for an engine built exactly like ``other``.

    Composed of parts, each owning its state: the scheduler and block manager (the
    requests and their KV), the model runner, ``pause`` (``PauseControl``: pause modes and
    their cost records) and ``updater`` (``Updater``: every hot update, versions, health,
    snapshots). Every update goes through ``update(source, options)``; SGLang's method
    names (``update_weights_from_disk``, ...) are adapters over it (``update/methods.py``),
    and the other calls delegate to the part whose contract they are. ``commit``: the
    commit step updates use (None: the engine's own; a grader passes a learner's).
    """

    def __init__(self, model_path, device: str = "cpu", dtype=None, enable_cuda_graph: bool | None = None,
                 max_num_seqs: int = 16, max_model_len: int | None = None, block_size: int = 16,
                 num_kv_blocks: int | None = None, max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool = True, seed: int = 0, cuda_graph_batch_sizes=None,
                 quantization: str | None = None, tp_rank: int = 0, tp_size: int = 1, load_format: str = "auto",
                 config: EngineConfig | None = None, commit=None):
        t0 = time.perf_counter()
        config = config or EngineConfig(
            device=device, dtype=dtype, block_size=block_size, num_kv_blocks=num_kv_blocks,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, enable_cuda_graph=enable_cuda_graph,
            cuda_graph_batch_sizes=cuda_graph_batch_sizes, seed=seed, quantization=quantization,
            tp_rank=tp_rank, tp_size=tp_size, load_format=load_format)
        self.model_path = str(model_path)
        # load_format="dummy": only config.json is read; the weights are random and the
        # engine refuses requests until real ones arrive (receive_weights_from_remote).
        reader = CheckpointReader(model_path) if config.load_format == "auto" else None
        self.model_config = reader.config if reader else ModelConfig.from_pretrained(model_path)
        self.config = config = config.resolved(self.model_config)
        self.timings: dict[str, float] = {}
        t1 = time.perf_counter()
        # tp_size > 1: this process is one rank of a TPEngine (engine/tp.py), which set up
        # the process group the sharded layers all-reduce over.
        shard = (config.device, config.dtype, config.tp_rank, config.tp_size, config.quantization)
        self.model = load_model(reader, *shard) if reader else dummy_model(self.model_config, *shard, config.seed)
        CopyPlan.for_model(self.model)  # where each checkpoint tensor lands, worked out before the first update
        self.timings["load_weights_s"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.model_runner = ModelRunner(self.model, self.model_config, config)
        self.timings["kv_and_graphs_s"] = time.perf_counter() - t1
        self.scheduler = Scheduler(config, self.block_manager, self.model_config.eos_token_id)
        self.tokenizer = ByteTokenizer.from_config(self.model_config)
        self.outbox: list[dict] = []        # outputs finished outside step() (aborts, drains); the next step() returns them
        self.pause = PauseControl(self.scheduler, self.block_manager, self.outbox, self.finish_request, self.step)
        # Recorded after graph capture: from here on no kernel-read tensor may move.
        self.address_audit = AddressAudit.record(self.model, self.model_runner.audited_tensors())
        self.updater = Updater(model=self.model, config=config, model_config=self.model_config,
                               scheduler=self.scheduler, block_manager=self.block_manager, tokenizer=self.tokenizer,
                               audit=self.address_audit, extras=lambda: self.model_runner.audited_tensors(),
                               pause=self.pause, commit=commit, waiting_for_weights=reader is None)
        self.num_prefill_tokens = 0         # tokens whose KV was computed by a prefill
        # Per step: which requests ran, prefill or decode, which version (the newest
        # STEP_LOG_SIZE steps; step_log.total counts them all).
        self.step_log = History(STEP_LOG_SIZE)
        self.requests: dict[str, Sequence] = {}  # unfinished requests by id
        self.num_requests = 0
        self.num_steps = 0
        self.timings["startup_s"] = time.perf_counter() - t0

    @property
    def quantization(self) -> str | None:
        """None, "int8" or "fp8": fixed at start-up (changing it needs a restart)."""
        return self.config.quantization

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, prompt: str | None = None, sampling_params=None, input_ids=None,
                    rid: str | None = None, return_logprob: bool = False) -> str:
        """Queue one request; returns its id. Raises ValueError for a prompt that cannot fit.
        ``return_logprob``: its output carries ``meta_info["output_token_logprobs"]``,
        SGLang's ``(logprob, token_id, None)`` per output token."""
        self.updater.check_healthy()
        if self.updater.waiting_for_weights:
            raise WaitingForWeightsError("waiting for weights: this engine started with load_format='dummy' "
                                         "and serves nothing until receive_weights_from_remote() loads them")
        if self.pause.paused:
            raise EnginePausedError("generation is paused for a weight update; retry after continue_generation()")
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        ids = self.tokenizer.encode(prompt) if prompt is not None else [int(t) for t in input_ids]
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"input_ids {bad[:5]} are outside the vocabulary [0, {self.model_config.vocab_size})")
        params = SamplingParams.coerce(sampling_params)
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens; the context holds {limit} "
                             f"(max_model_len), leaving no room to generate")
        blocks_needed = -(-min(len(ids) + params.max_new_tokens, limit) // self.config.block_size)
        if blocks_needed > self.block_manager.num_free_blocks + len(self.block_manager.used_block_ids):
            raise ValueError(f"request needs {blocks_needed} KV blocks; the pool has {len(self.block_manager.blocks)}")
        if rid is not None and rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        # Unseeded sampling is still reproducible: the n-th request of an engine draws from seed + n.
        seq = Sequence(ids, params, self.config.block_size, rid, default_seed=self.config.seed + self.num_requests,
                       return_logprob=bool(return_logprob))
        self.num_requests += 1
        self.requests[seq.rid] = seq
        self.scheduler.add(seq)
        return seq.rid

    def abort_request(self, rid: str, message: str = "aborted", reason_type: str = "abort") -> bool:
        """End request ``rid`` now, running or queued: its KV blocks are freed and its output
        (``finish_reason {"type": reason_type, "message": message}``, the tokens so far)
        comes out of the next ``step()``, as every abort does. ``reason_type`` is "abort"
        (its caller gave up) or "error" (a step failed on it). Returns False, changing
        nothing, for an id that is not running or queued (unknown, or finished already)."""
        if reason_type not in ("abort", "error"):
            raise ValueError(f"reason_type must be 'abort' or 'error', got {reason_type!r}")
        if not isinstance(message, str):
            raise ValueError(f"message must be a str, got {type(message).__name__}")
        seq = self.requests.get(rid) if isinstance(rid, str) else None
        if seq is None:
            return False
        self.outbox.append(self.finish_request(seq, {"type": reason_type, "message": message}))
        return True

    def finish_request(self, seq: Sequence, reason: dict) -> dict:
        """End ``seq`` now with finish reason ``reason`` (its KV blocks freed); returns its
        output. The caller hands the output on (``outbox``: the next ``step()`` returns it)."""
        self.scheduler.finish(seq, reason)
        return self._output(seq)

    def has_unfinished_requests(self) -> bool:
        """True while requests are queued or running, or finished outputs (e.g. aborts)
        wait for the next ``step()`` to return them."""
        return self.scheduler.has_unfinished() or bool(self.outbox)

    def step(self) -> list[dict]:
        """One engine step; returns the outputs of requests that finished in it (and of
        requests aborted since the last step). While paused, only ``wait`` mode runs."""
        # Emptied in place, not replaced: the outbox is shared with the pause control, and a
        # caller that writes ``outbox += self.step()`` (wait mode's drain) then keeps each
        # output once, instead of adding the old list's outputs to themselves at every step.
        outputs = list(self.outbox)
        self.outbox.clear()
        try:
            return outputs + self._step()
        except BaseException:
            self.outbox[:0] = outputs  # a failed step loses no finished output
            raise

    def _step(self) -> list[dict]:
        self.updater.check_healthy()
        if self.pause.paused and self.pause.pause_mode != "wait":
            return []
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return []
        if is_prefill:
            for seq in seqs:
                computed = seq.num_tokens - seq.num_cached_tokens
                self.num_prefill_tokens += computed
                if seq.retract_record is not None:  # measured, not predicted: what retract cost
                    seq.retract_record.reprefill_tokens += computed
                    seq.retract_record = None
        token_ids = self.model_runner.run(seqs, is_prefill)
        finished = self.scheduler.postprocess(seqs, token_ids, self.weight_version)
        self.step_log.append({"step": self.num_steps, "prefill": is_prefill, "version": self.weight_version,
                              "rids": [s.rid for s in seqs]})
        self.num_steps += 1
        return [self._output(seq) for seq in finished]

    def _output(self, seq: Sequence) -> dict:
        self.requests.pop(seq.rid, None)
        return {
            "rid": seq.rid,
            "text": self.tokenizer.decode(seq.completion_token_ids),
            "output_ids": seq.completion_token_ids,
            "meta_info": {
                "id": seq.rid,
                "prompt_tokens": seq.num_prompt_tokens,
                "completion_tokens": seq.num_completion_tokens,
                "cached_tokens": seq.prefix_hit_tokens,
                "finish_reason": seq.finish_reason,
                "weight_version": seq.token_versions[-1] if seq.token_versions else self.weight_version,
                "weight_versions": _weight_versions(seq),
                "e2e_latency": time.perf_counter() - seq.arrival_time,
                **({"output_token_logprobs": [(lp, tok, None) for lp, tok in
                                              zip(seq.output_logprobs, seq.completion_token_ids)]}
                   if seq.return_logprob else {}),
            },
        }

    def generate(self, prompts=None, sampling_params=None, input_ids=None, return_logprob=False) -> list[dict]:
        """Generate for a prompt or a list of prompts (or token-id lists); outputs in input order.
        ``return_logprob``: one flag for all, or one per prompt (see ``add_request``)."""
        if (prompts is None) == (input_ids is None):
            raise ValueError("give exactly one of prompts or input_ids")
        if prompts is not None:
            items = [prompts] if isinstance(prompts, str) else list(prompts)
            key = "prompt"
        else:
            items = [input_ids] if input_ids and isinstance(input_ids[0], int) else list(input_ids)
            key = "input_ids"
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        if len(params) != len(items):
            raise ValueError(f"{len(params)} sampling_params for {len(items)} prompts")
        params = [SamplingParams.coerce(p) for p in params]  # validate all before queueing any
        flags = return_logprob if isinstance(return_logprob, list) else [return_logprob] * len(items)
        if len(flags) != len(items):
            raise ValueError(f"{len(flags)} return_logprob flags for {len(items)} prompts")
        rids = [self.add_request(**{key: item}, sampling_params=p, return_logprob=f)
                for item, p, f in zip(items, params, flags)]
        # Only this call's requests are waited for: requests already in flight (kept across a
        # pause, or added by another caller) finish in the same steps and must not count.
        mine, done = set(rids), {}
        while len(done) < len(mine):
            if not self.has_unfinished_requests():
                raise RuntimeError("requests vanished before finishing")  # a bug, never expected
            for out in self.step():
                if out["rid"] in mine:
                    done[out["rid"]] = out
        return [done[r] for r in rids]

    # ---- introspection -----------------------------------------------------------------
    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> torch.Tensor:
        """The current values of checkpoint tensor ``name`` (its first ``truncate_size``
        rows), read back out of the engine's fused, sharded or quantized parameters
        (dequantized for int8/fp8; this rank's shard under tensor parallelism).
        Raises KeyError for a name the model does not have."""
        return read_checkpoint_tensor(self.model, name, truncate_size)

    @property
    def prefix_cache_stats(self) -> dict:
        bm = self.block_manager
        return {"hit_tokens": bm.hit_tokens, "queried_tokens": bm.queried_tokens,
                "cached_blocks": len(bm.hash_to_block_id)}

    # ---- state the parts own, read through the engine ------------------------------------
    paused = property(lambda self: self.pause.paused, doc="Generation is paused for an update.")
    pause_mode = property(lambda self: self.pause.pause_mode, doc="The current pause's mode (None: not paused).")
    pause_stats = property(lambda self: self.pause.stats, doc="A PauseRecord per pause, the newest ones.")
    last_flush_entries = property(lambda self: self.pause.last_flush_entries)
    weight_version = property(lambda self: self.updater.weight_version, doc="The live weights' version label.")
    weight_update_count = property(lambda self: self.updater.weight_update_count)
    update_history = property(lambda self: self.updater.history, doc="An UpdateResult per update, the newest ones.")
    snapshot = property(lambda self: self.updater.snapshot, doc="The host Snapshot rollback() restores, if any.")
    unhealthy = property(lambda self: self.updater.unhealthy, doc="Why the engine refuses work (None: healthy).")
    waiting_for_weights = property(lambda self: self.updater.waiting_for_weights)

    # ---- updates: the one entry (SGLang's names are adapters over it: update/methods.py) ----
    def update(self, source, options: UpdateOptions | None = None) -> dict:
        """Run one hot update from ``source`` (``course_lib.update.sources``) with
        ``options`` (``UpdateOptions``): see ``Updater.update``."""
        return self.updater.update(source, options)

    # ---- calls that belong to one part (its contract is there) -----------------------------
    pause_generation = delegate("pause", PauseControl.pause_generation)
    flush_cache = delegate("pause", PauseControl.flush_cache)
    continue_generation = delegate("updater", Updater.continue_generation)
    update_weight_version = delegate("updater", Updater.update_weight_version)
    health = delegate("updater", Updater.health)
    verify_addresses = delegate("updater", Updater.verify_addresses)
    take_snapshot = delegate("updater", Updater.take_snapshot)
    register_weight_buffers = delegate("updater", Updater.register_weight_buffers)
    unregister_weight_buffers = delegate("updater", Updater.unregister_weight_buffers)
    init_weights_update_group = delegate("updater.transfers", Transfers.init_group)
    destroy_weights_update_group = delegate("updater.transfers", Transfers.destroy_group)

    def get_weight_version(self) -> str:
        return self.updater.weight_version

    def live_kv_is_fresh(self) -> bool:
        return self.pause.live_kv_is_fresh(self.updater.weight_update_count)

    def send_weights_to_remote(self, master_address: str, master_port: int, group_name: str = "remote_seed",
                               backend: str | None = None, bucket_bytes: int | None = None) -> dict:
        """Seed a new engine: be rank 0 of a two-rank group and broadcast this engine's
        checkpoint-format weights in buckets (see remote.py). Blocks until the new engine
        joins and has received everything. Raises ``RemoteSeedError`` if it refuses them
        (a different structure), or if this engine cannot send exact weights (quantized,
        a tensor-parallel rank, itself still waiting). Requests in flight keep their
        state; the weights are only read."""
        return remote.send(self, master_address, master_port, group_name, backend,
                           bucket_bytes or DEFAULT_BUCKET_BYTES)


def _weight_versions(seq: Sequence) -> list[dict]:
    """An output's version spans (``Sequence.version_spans``, kept by chapter 02's
    ``tag_token``). While that part is a stub no token is tagged, so outputs report no
    spans and the chapters before 02 still generate."""
    return seq.version_spans()
