"""Engine-level scenarios replayed on the learner's engine and on the reference (twin.py).

A scenario is a list of operations, each a JSON list, applied in order to a fresh
``Engine`` on checkpoint ``paths[0]``:

    ["submit", tokens, n]        a request (ids r0, r1, ... in order) for n greedy tokens
    ["step"]                      one engine step
    ["steps", k]                  k steps
    ["pause", mode]               pause_generation(mode)
    ["continue"]                  continue_generation()
    ["update", k, options]        update_weights_from_disk(paths[k], weight_version=f"v{k}", **options)
    ["abort", i]                  abort_request(f"r{i}")
    ["flush"]                     flush_cache()
    ["snapshot"]                  take_snapshot()
    ["rollback", options]         rollback(**options)
    ["preempt", i]                scheduler.preempt(request r{i}, out_of_memory=False), if r{i} is in flight
    ["promote", k, ref, options]  production.promote_or_rollback to paths[k], the expected answers
                                  those of a fresh engine on paths[ref] (PROMPTS), options: pause_mode,
                                  min_agreement, quality (a name in QUALITY), min_quality, partial,
                                  max_new_tokens

``make_paths(dir)`` writes the checkpoints scenarios use: three random versions, the last
one again with a NaN in its last layer (a fault found mid-stream), a path that does
not exist, and None.

After each operation the scenario records what it returned (an exception as its type
alone: wording is the learner's own) and everything observable about the engine: queue
order, pause state, versions, KV blocks and prefix-cache entries, each unfinished
request's tokens, their versions and cached prefix, the latest pause record (less its
clock), and every output a step returned. Clocks and timings are never recorded, nor which
writer an update took.
"""
from __future__ import annotations

import hashlib

import torch

TIMED = ("wait_s", "resume_ms", "e2e_latency", "timings_ms", "memory")
# Which writer an update took depends on which of the course's parts are written (a learner's
# edition takes the plain path where a later chapter's part is still a stub), not on the
# part graded here: an update's result is compared without it.
NOT_COMPARED = TIMED + ("writer", "writers_declined")


# The errors the contracts name: the builtins and the engine's own error classes. A class
# no contract names (the dtype parser's DtypeError, a learner's own subclass) is reported as
# the nearest named class above it: a DtypeError is the ValueError a contract asks for.
CONTRACT_ERRORS = {"ApiError", "EngineError", "ConfigError", "WorkerError", "EnginePausedError", "EngineBusyError",
                   "SettingsError", "SparsePayloadError", "DeltaError", "BaseMismatchError", "UnsafePickleError",
                   "WaitingForWeightsError", "RemoteSeedError", "RegistrationError", "BucketError", "UpdateError",
                   "AddressMovedError", "ReshardError", "CheckpointError"}


def error_kind(exc: BaseException) -> str:
    """The name of ``exc``'s class as the contracts speak of it (CONTRACT_ERRORS above)."""
    for cls in type(exc).__mro__:
        if cls.__module__ == "builtins" or cls.__name__ in CONTRACT_ERRORS:
            return cls.__name__
    return type(exc).__name__


def _scrub(value):
    """JSON-able, without clocks and timings."""
    if isinstance(value, dict):
        return {str(k): _scrub(v) for k, v in value.items() if k not in NOT_COMPARED and not str(k).endswith("_ms")}
    if isinstance(value, (list, tuple)):
        return [_scrub(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, torch.Tensor):
        return weights_digest({"t": value})
    return repr(type(value).__name__)


def dense_copy(t: torch.Tensor) -> torch.Tensor:
    """A fresh row-major copy on the host (``contiguous()`` may keep odd strides on size-1
    dimensions, which a dtype view refuses)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())


def tensor_digest(t: torch.Tensor) -> str:
    """The tensor's values as bytes in row-major order, with its dtype and shape: equal
    values, equal digest, whatever the view's strides or device."""
    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    h.update(dense_copy(t).reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def weights_digest(tensors: dict) -> str:
    """A digest of the bytes of named tensors (equal bytes, equal digest)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensor_digest(tensors[name]).encode())
    return h.hexdigest()[:16]


class Names:
    """Request ids as scenarios name them: r0, r1, ... for submitted requests; others (a
    canary's, whose ids are random) g0, g1, ... in the order they are first seen."""

    def __init__(self):
        self.alias: dict[str, str] = {}

    def __call__(self, rid: str) -> str:
        if rid.startswith("r") and rid[1:].isdigit():
            return rid
        return self.alias.setdefault(rid, f"g{len(self.alias)}")


def observe(engine, outputs: list, name=lambda rid: rid) -> dict:
    s, bm = engine.scheduler, engine.block_manager
    outputs = [dict(o, rid=name(o["rid"]), meta_info=dict(o["meta_info"], id=name(o["rid"]))) for o in outputs]
    record = engine.pause_stats[-1].as_dict() if len(engine.pause_stats) else None
    snapshot = engine.snapshot
    return {
        "running": [name(q.rid) for q in s.running],
        "waiting": [name(q.rid) for q in s.waiting],
        "paused": engine.paused,
        "pause_mode": engine.pause.pause_mode,
        "version": engine.weight_version,
        "updates": engine.updater.weight_update_count,
        "free_blocks": bm.num_free_blocks,
        "used_blocks": len(bm.used_block_ids),
        "cache_entries": len(bm.hash_to_block_id),
        "preemptions": s.num_preemptions,
        "outbox": len(engine.outbox),
        "requests": {name(rid): {"tokens": list(q.token_ids), "versions": list(q.token_versions),
                           "cached": q.num_cached_tokens, "blocks": len(q.block_table)}
                     for rid, q in engine.requests.items()},
        "pause_record": _scrub(record),
        "last_flush_entries": engine.pause.last_flush_entries,
        "snapshot_version": snapshot.weight_version if snapshot is not None else None,
        "unhealthy": engine.unhealthy is not None,
        "outputs": [_scrub(o) for o in outputs],
    }


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6, 5], [40, 41, 42, 43, 44, 45]]


def _quality_raises(engine):
    raise RuntimeError("the quality metric failed")


# Quality metrics by name (scenarios are JSON): constants, one that fails, and one that
# reads the weights (so it must be read on the new ones).
QUALITY = {
    "high": lambda engine: 1.0,
    "low": lambda engine: -1.0,
    "raises": _quality_raises,
    "logit": lambda engine: float(_first_logit(engine)),
}


def _first_logit(engine):
    from course_lib.testing import prompt_logits
    return prompt_logits(engine, PROMPTS[0])[-1].max()


def make_paths(directory) -> list[str]:
    from pathlib import Path

    from course_lib.weights.checkpoint import CheckpointReader, make_random, write_checkpoint
    d = Path(directory)
    paths = [str(make_random(d / f"v{i}", "tiny", seed=2026 + i)) for i in range(3)]
    reader = CheckpointReader(paths[2])
    tensors = {n: t.clone() for n, t in reader.iter_tensors()}
    last = reader.config.num_hidden_layers - 1  # streamed last: earlier layers are written first
    tensors[f"model.layers.{last}.mlp.down_proj.weight"].view(-1)[7] = float("nan")
    paths.append(str(write_checkpoint(d / "nan", reader.config, tensors)))
    paths.append(str(d / "missing"))
    paths.append(None)  # not a path at all: a TypeError, which no caller should mistake for a refusal
    return paths


def _promote(engine, paths, ref, path_index, options):
    from course_lib import Engine, production
    opts = dict(options)
    n = opts.pop("max_new_tokens", 5)
    quality = QUALITY[opts.pop("quality")] if "quality" in opts else None
    reference = production.greedy_outputs(Engine(paths[ref], block_size=4), PROMPTS, n)
    got = production.promote_or_rollback(engine, paths[path_index], PROMPTS, reference, weight_version=f"v{path_index}",
                                         quality=quality, max_new_tokens=n, **opts)
    # The reasons' wording is the learner's own: how many there are is compared.
    return dict(got, reasons=len(got["reasons"])) if isinstance(got, dict) and "reasons" in got else got


def _apply(engine, op, paths, submitted):
    kind = op[0]
    if kind == "submit":
        rid = f"r{len(submitted)}"
        submitted.append(rid)
        return engine.add_request(input_ids=op[1], rid=rid,
                                  sampling_params={"max_new_tokens": op[2], "temperature": 0, "ignore_eos": True})
    if kind == "step":
        return engine.step()
    if kind == "steps":
        out = []
        for _ in range(op[1]):
            out += engine.step()
        return out
    if kind == "pause":
        return engine.pause_generation(op[1])
    if kind == "continue":
        return engine.continue_generation()
    if kind == "update":
        return engine.update_weights_from_disk(paths[op[1]], weight_version=f"v{op[1]}", **op[2])
    if kind == "abort":
        return engine.abort_request(f"r{op[1]}")
    if kind == "flush":
        return engine.flush_cache()
    if kind == "snapshot":
        return engine.take_snapshot().weight_version
    if kind == "rollback":
        return engine.rollback(**op[1])
    if kind == "preempt":
        seq = engine.requests.get(f"r{op[1]}")
        if seq is None or seq.is_finished:
            return None
        return engine.scheduler.preempt(seq, out_of_memory=False)
    if kind == "promote":
        return _promote(engine, paths, op[2], op[1], op[3])
    raise ValueError(f"unknown operation {op!r}")


def replay(paths: list, ops: list, engine_kwargs: dict) -> list:
    """One observation per operation: {"returned" or "raised", and the engine's state}."""
    from course_lib import Engine

    torch.set_num_threads(1)
    engine = Engine(paths[0], **engine_kwargs)
    submitted, trace, names = [], [], Names()
    for op in ops:
        outputs = []
        try:
            ret = _apply(engine, op, paths, submitted)
            if op[0] in ("step", "steps"):
                outputs, ret = ret, len(ret)
            entry = {"returned": _scrub(ret)}
        except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
            entry = {"raised": error_kind(exc)}
        entry["state"] = observe(engine, outputs, names)
        trace.append(entry)
        if entry["state"]["unhealthy"]:
            break
    entry = {"weights": weights_digest(dict(engine.model.state_dict()))}
    trace.append(entry)
    return trace


def call(function: str, args: list, kwargs: dict | None = None) -> dict:
    """Call ``module:function`` with JSON arguments: what it returned (or which error it
    raised) and the arguments afterwards (a function that must not change its inputs)."""
    import copy
    import importlib

    module, name = function.split(":")
    f = getattr(importlib.import_module(module), name)
    args, kwargs = copy.deepcopy(args), copy.deepcopy(kwargs or {})
    try:
        out = {"returned": _scrub(f(*args, **kwargs))}
    except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
        out = {"raised": error_kind(exc)}
    out["arguments_after"] = _scrub([args, kwargs])
    return out
