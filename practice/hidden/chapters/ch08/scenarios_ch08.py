"""Chapter 08's token weights and per-step sync called on JSON inputs, observed as JSON: run
here on the learner's ``course_lib`` and in the reference's process (``twin``), for the
differential cases. Log-probabilities arrive as lists and become tensors of the drawn dtype
here; the sync runs on a real engine built from a seed (see ``sync_step``)."""
from __future__ import annotations

import hashlib
import inspect
import math
import tempfile
import time

import torch

from engine_scenarios import tensor_digest, error_kind


def _float(x: float):
    """A float as JSON can carry it and compare it: NaN and infinities as names."""
    return x if math.isfinite(x) else repr(x)


def weights(spans, current, logp_now, logp_by_version, clip, dtype) -> dict:
    from course_lib.rl.corrections import importance
    dt = getattr(torch, dtype)
    now = torch.tensor(logp_now, dtype=dt)
    held = {v: torch.tensor(lp, dtype=dt) for v, lp in logp_by_version.items()}
    before = [now.clone(), {v: t.clone() for v, t in held.items()}, [dict(s) for s in spans]]
    try:
        out = importance(spans, current, now, held, clip)
        seen = {"returned": {"type": type(out).__name__, "dtype": str(getattr(out, "dtype", None)),
                             "shape": list(getattr(out, "shape", [])),
                             "values": [_float(x) for x in out.double().tolist()] if torch.is_tensor(out) else None,
                             "shares_storage_with_logp_now": torch.is_tensor(out) and out.numel() > 0
                             and out.untyped_storage().data_ptr() == now.untyped_storage().data_ptr()}}
    except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
        seen = {"raised": error_kind(exc)}
    seen["inputs_unchanged"] = (torch.equal(now, before[0]) or bool(torch.isnan(now).any()))  \
        and all(torch.equal(held[v], t) or bool(torch.isnan(t).any()) for v, t in before[1].items()) \
        and spans == before[2]
    return seen


# ---- exercise 1: the per-step sync ----------------------------------------------------------
#
# A real engine (chapter 08's small policy) and a trainer's tensors, both from a seed. The
# engine's methods that the sync may call are wrapped on the instance: each call is logged
# with its arguments (bound to the engine's signature, so a keyword or a positional argument
# log alike), and once the engine has done the work, the call moves the time module's
# monotonic clocks (``perf_counter``, ``monotonic`` and their ``_ns`` forms; ``time.time`` is
# left alone) forward by a known amount of its own. The update's report is replaced by
# figures fixed here (its phases and bytes), so what the sync hands back can be compared
# with the reference's exactly, in every process.

# Seconds each engine call moves the monotonic clocks: decimal digits of their own in the
# figures, in units of 1000 s (``_units``), far above the real time any call here takes.
CLOCK_STEP_S = {"pause_generation": 1.0e5, "continue_generation": 1.0e4,
                "update_weights_from_tensor": 1.0e6, "flush_cache": 1.0e7}
UNIT_MS = 1.0e6  # 1000 s in milliseconds: one "unit" of the figures compared
_CHECKPOINTS: dict = {}
_TMP = None


def _checkpoint(seed: int):
    global _TMP
    from course_lib.rl import task
    if _TMP is None:
        _TMP = tempfile.TemporaryDirectory(prefix="ch08-sync-")
    if seed not in _CHECKPOINTS:
        _CHECKPOINTS[seed] = task.initial_checkpoint(f"{_TMP.name}/start-{seed}", seed=seed)
    return _CHECKPOINTS[seed]


class _Clocks:
    """The monotonic clocks of the time module, plus an offset that only the wrapped engine
    calls move; put back by ``restore``."""

    NAMES = ("perf_counter", "monotonic", "perf_counter_ns", "monotonic_ns")

    def __init__(self):
        self.offset, self.saved = 0.0, {name: getattr(time, name) for name in self.NAMES}
        for name, real in self.saved.items():
            if name.endswith("_ns"):
                setattr(time, name, lambda real=real: real() + int(self.offset * 1e9))
            else:
                setattr(time, name, lambda real=real: real() + self.offset)

    def restore(self):
        for name, real in self.saved.items():
            setattr(time, name, real)


def _payload(value):
    """What an update call was handed: how many (name, tensor) pairs (or dict items), and a
    digest of their names and bytes in order; for a serialized bucket, only that it is one (its handles name shared
    memory that differs from run to run)."""
    if isinstance(value, (str, bytes)):
        return "serialized"
    if isinstance(value, dict):
        value = list(value.items())
    if isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        h = hashlib.sha256()
        for n, t in value:
            h.update(f"{n}={tensor_digest(t) if isinstance(t, torch.Tensor) else type(t).__name__};".encode())
        return {"pairs": len(value), "names_and_bytes": h.hexdigest()[:16]}
    return type(value).__name__


def _instrument(engine, clocks, log):
    """Wrap the engine's pause, continue, update and flush on the instance (see above)."""
    signatures = {"pause_generation": inspect.signature(engine.pause.pause_generation),
                  "continue_generation": inspect.signature(engine.updater.continue_generation),
                  "update_weights_from_tensor": inspect.signature(engine.update_weights_from_tensor),
                  "flush_cache": inspect.signature(engine.pause.flush_cache)}
    updates = [0]

    def wrap(method):
        original = getattr(engine, method)

        def logged(*args, **kwargs):
            bound = signatures[method].bind(*args, **kwargs)
            bound.apply_defaults()
            entry = [method, {k: (_payload(v) if k == "named_tensors" else
                                  v if isinstance(v, (str, int, float, bool, type(None))) else type(v).__name__)
                              for k, v in bound.arguments.items() if k != "wait_timeout_s"}]
            log.append(entry)
            try:
                result = original(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - logged, then raised on to the sync
                entry.append({"raised": error_kind(exc)})
                raise
            finally:
                clocks.offset += CLOCK_STEP_S[method]
            if method == "update_weights_from_tensor":
                # Figures of its own for each update call, exact in binary (sums of them too).
                k = updates[0] = updates[0] + 1
                result = dict(result, timings_ms={"deserialize": 0.5 * k, "validate": 0.25 + k, "copy": 2.0 ** -k,
                                                  "audit": 8.0 * k}, bytes=4096 * k + 3)
            return result
        setattr(engine, method, logged)  # the instance's attribute: the sync's calls go through it

    for method in signatures:
        wrap(method)


def _units(ms):
    """A reported figure in units of 1000 s (see ``CLOCK_STEP_S``), and what it is."""
    if isinstance(ms, bool) or not isinstance(ms, (int, float)):
        return {"not_a_number": type(ms).__name__}
    return round(ms / UNIT_MS)


def _broken(named, fault, gen):
    if fault is None:
        return named
    named = list(named)
    i = int(torch.randint(len(named), (1,), generator=gen))
    name, t = named[i]
    if fault == "shape":
        named[i] = (name, t.reshape(-1) if t.dim() > 1 else t[:-1])
    elif fault == "name":
        named.insert(i, ("model.layers.7.mlp.up_proj.weight", t))
    else:
        named[i] = (name, torch.zeros(t.shape, dtype=torch.int32))
    return named


def sync_step(transport: str, pause_mode, version, seed: int, fault=None, in_flight: int = 0, paused_before=None,
              bucket_kb: int = 4) -> dict:
    """One ``sync`` of ``transport`` ("inprocess" or "ipc") with ``pause_mode`` and
    ``version`` ("<bytes>" stands for ``b"step-1"``), on an engine with ``in_flight``
    requests running, maybe already paused (``paused_before``: a mode), and a trainer's
    tensors, maybe with a ``fault`` ("shape", "name", "dtype") the engine refuses.
    Observed: what the sync returned (its fields, the phases in order, each engine phase's
    figure and type, "pause" and "continue" in units of 1000 s, the bytes and their type) or
    which error; the engine calls in order with their arguments; the engine afterwards
    (paused, in which mode, its label, its pause records, its update count); then, resumed
    and run to the end, each request's finish reason and the versions its tokens carry."""
    from course_lib import Engine
    from course_lib.rl import task
    from course_lib.rl.sync import InProcessSync, IpcSync
    from course_lib.weights.checkpoint import random_state_dict
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(seed)
    engine = Engine(_checkpoint(seed % 3), block_size=8, max_num_seqs=8)
    engine.update_weight_version("step-0")
    rids = [engine.add_request(task.PROMPTS[i % 2], {"max_new_tokens": 5 + i % 3, "temperature": 1.0,
                                                     "seed": seed + i, "ignore_eos": True})
            for i in range(in_flight)]
    done = []
    for _ in range(1 + seed % 2 if in_flight else 0):
        done += engine.step()
    if paused_before is not None:
        engine.pause_generation(paused_before)
    named = _broken(list(random_state_dict(task.POLICY_CONFIG, 1000 + seed).items()), fault, gen)
    label = b"step-1" if version == "<bytes>" else version
    sync = InProcessSync(engine) if transport == "inprocess" else IpcSync(engine, bucket_bytes=bucket_kb << 10)
    calls, clocks = [], _Clocks()
    _instrument(engine, clocks, calls)
    update_step = sync._update

    def logged_update_step(*args, **kwargs):  # this sync's update step, as the contract names it
        calls.append(["the sync's update step"])
        return update_step(*args, **kwargs)
    sync._update = logged_update_step
    try:
        out = sync.sync(named, label, pause_mode)
    except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
        seen = {"raised": error_kind(exc)}
    else:
        seen = {"returned": _returned(out)}
    finally:
        clocks.restore()
    for method in CLOCK_STEP_S:
        del engine.__dict__[method]  # the engine's own methods again
    seen["calls"] = calls
    seen["engine_after"] = {"paused": engine.paused, "pause_mode": engine.pause.pause_mode if engine.paused else None,
                            "version": engine.weight_version, "pauses": [p.mode for p in engine.pause_stats],
                            "updates": len(engine.update_history)}
    if engine.paused:
        engine.continue_generation()
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        done += engine.step()
    outs = {o["rid"]: o for o in done}
    seen["requests"] = [{"finish": outs[r]["meta_info"]["finish_reason"]["type"],
                         "versions": [s["version"] for s in outs[r]["meta_info"]["weight_versions"]]}
                        if r in outs else "never finished" for r in rids]
    return seen


def _returned(out) -> dict:
    if not isinstance(out, dict):
        return {"type": type(out).__name__}
    seen = {"type": "dict", "fields": sorted(map(str, out))}
    phases, nbytes = out.get("phases_ms"), out.get("bytes")
    if isinstance(phases, dict):
        seen["phase_order"] = [str(k) for k in phases]
        seen["phases"] = {str(k): _units(v) if k in ("pause", "continue") else
                          [v if isinstance(v, (int, float)) else repr(v), type(v).__name__]
                          for k, v in phases.items()}
    else:
        seen["phases_ms"] = type(phases).__name__
    seen["bytes"] = [nbytes if isinstance(nbytes, (int, float)) else repr(nbytes), type(nbytes).__name__]
    return seen
