"""Chapter 04 scenarios, run on the learner's course_lib and on the reference (shared/twin.py).

Each function takes JSON arguments (a seed, operations as lists, flags), builds a small
engine on a ``tiny`` checkpoint made from the seed, applies the operations and returns JSON
observations after each one: what it returned or which error type it raised, which
parameters' bytes changed, whether any parameter or copy-plan view left its memory
(compared as "the same as at the start", never as raw addresses, which differ between
processes), whether the tensors handed in were left as they were, and the audit's lines
(with hex addresses written as ``0x?``).

Operations (``ops``), each a list:

    ["apply", entries, how]          CopyPlan.apply(...) on the engine's plan; ``how``: "list",
                                     "generator" or "items" (a dict's items view)
    ["update", entries, finite]      engine.update_weights_from_tensor(pairs, check_finite=finite)
    ["rebind", k] / ["shrink", k] / ["retype", k]
                                     parameter k (of the sorted names) given new memory, fewer
                                     rows at the same address, or another dtype at the same address
    ["kv_clone"]                     the engine's KV pool replaced by a copy
    ["check", only, extra]           the audit's violations: ``only`` None or a list of parameter
                                     indices, names added as given; ``extra`` "engine", "none" or
                                     "empty" (the engine's extras, None, {})
    ["verify"]                       engine.verify_addresses()

An entry is ``[k, kind, dtype]``: checkpoint name k (of the plan's sorted names) with a tensor
of ``dtype``; ``kind`` "good" (its view's shape), "strided" (that shape, not contiguous),
"nan" (a NaN in it), "int" (int32 values), or a refused one: "transposed" (same count, other
shape), "flat", "row" (one broadcastable row), "unsqueeze" (a leading 1: broadcastable),
"unknown" (a name the model does not have).
"""
from __future__ import annotations

import re
import tempfile

import torch

from engine_scenarios import _scrub, tensor_digest as digest, error_kind

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
_CHECKPOINTS: dict = {}


def _checkpoint(seed: int, tied: bool) -> str:
    from course_lib.weights.checkpoint import make_random, preset
    key = (seed, tied)
    if key not in _CHECKPOINTS:
        d = tempfile.mkdtemp(prefix="ch04-differential-")
        _CHECKPOINTS[key] = str(make_random(f"{d}/ckpt", preset("tiny", tie_word_embeddings=tied), seed=seed))
    return _CHECKPOINTS[key]


def _engine(seed: int, tied: bool):
    from course_lib import Engine
    torch.set_num_threads(1)
    return Engine(_checkpoint(seed, tied), max_model_len=64, block_size=4)


def _plan(engine, tied: bool):
    from course_lib.weights.commit.copy_plan import CopyPlan
    plan = CopyPlan.for_model(engine.model)
    if tied:  # the contract's tied lm_head: a name the plan keeps with no view (skipped)
        plan = CopyPlan.from_views({**plan.views, "lm_head.weight": None})
    return plan


def _tensor(gen: torch.Generator, shape, kind: str, dtype: torch.dtype) -> torch.Tensor:
    shape = tuple(shape)
    if kind == "int":
        return torch.randint(-3, 4, shape, generator=gen, dtype=torch.int32)
    if kind == "strided":  # the right shape, read through strides: the transpose of a transposed copy,
        big = torch.randn(tuple(reversed(shape)) if len(shape) == 2 else (2 * shape[0],), generator=gen)
        t = big.t() if len(shape) == 2 else big[::2]  # or every other element of a longer vector
        return t.to(dtype) if dtype != torch.float32 else t
    t = torch.randn(shape, generator=gen).to(dtype)
    if kind == "nan":
        t.view(-1)[int(torch.randint(0, t.numel(), (1,), generator=gen))] = float("nan")
    return t


def _bad(t: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "transposed":
        return t.t() if t.dim() == 2 and t.shape[0] != t.shape[1] else t.reshape(-1)[: t.numel() // 2].reshape(2, -1)
    if kind == "flat":
        return t.reshape(-1) if t.dim() == 2 else t.reshape(1, -1)
    if kind == "row":
        return t[:1]
    if kind == "unsqueeze":
        return t.unsqueeze(0)
    raise ValueError(kind)


def named_tensors(names: list[str], shapes: dict, entries: list, gen: torch.Generator) -> list:
    out = []
    for k, kind, dtype in entries:
        name = names[k % len(names)]
        if kind == "unknown":
            name, kind = f"model.layers.{7 + k % 3}.mlp.up_proj.weight", "good"
        shape = shapes.get(name, (128, 64))
        t = _tensor(gen, shape, kind if kind in ("good", "strided", "nan", "int") else "good", DTYPES[dtype])
        if kind in ("transposed", "flat", "row", "unsqueeze"):
            t = _bad(t, kind)
        out.append((name, t))
    return out


def _params(engine) -> dict:
    return dict(engine.model.named_parameters())


def _state(engine) -> dict:
    return {n: digest(p) for n, p in _params(engine).items()}


def _lines(lines) -> list:
    return [re.sub(r"0x[0-9a-fA-F]+", "0x?", str(line)) for line in lines]


def _feed(pairs: list, how: str):
    if how == "generator":
        return (p for p in pairs)
    if how == "items":
        return dict(pairs).items()
    return list(pairs)


def commit_trace(seed: int, tied: bool, ops: list) -> list:
    """Random in-process updates of one engine, through its copy plan and through
    ``update_weights_from_tensor``: one observation per operation, then the final weights."""
    engine = _engine(seed, tied)
    plan = _plan(engine, tied)
    names = sorted(plan.views)
    shapes = {n: tuple(v.shape) for n, v in plan.views.items() if v is not None}
    shapes.setdefault("lm_head.weight", shapes["model.embed_tokens.weight"])
    start_params = _params(engine)
    start_ptrs = {n: p.data_ptr() for n, p in start_params.items()}
    start_views = {n: v.data_ptr() for n, v in plan.views.items() if v is not None}
    trace = []
    for i, op in enumerate(ops):
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        pairs = named_tensors(names, shapes, op[1], gen)
        sent = [digest(t) for _, t in pairs]
        before = _state(engine)
        try:
            if op[0] == "apply":
                entry = {"returned": _scrub(plan.apply(_feed(pairs, op[2])))}
            else:
                entry = {"returned": _scrub(engine.update_weights_from_tensor(
                    list(pairs), check_finite=op[2], weight_version=f"u{i}"))}
        except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
            entry = {"raised": error_kind(exc)}
        after = _state(engine)
        params = _params(engine)
        entry.update(
            changed=[n for n in after if after[n] != before.get(n)],
            moved=[n for n, p in params.items() if start_params.get(n) is not p or p.data_ptr() != start_ptrs[n]]
                  + [f"view {n}" for n, v in plan.views.items() if v is not None and v.data_ptr() != start_views[n]],
            inputs_unchanged=[digest(t) for _, t in pairs] == sent,
            version=engine.weight_version, healthy=engine.updater.unhealthy is None)
        trace.append(entry)
    trace.append({"weights": _state(engine)})
    return trace


def audit_trace(seed: int, tied: bool, ops: list) -> list:
    """The engine's own audit (recorded at start-up by the learner's ``AddressAudit``) after
    random moves, clean updates and checks: its record, then one observation per operation."""
    from course_lib.weights.commit.audit import kernel_tensors
    engine = _engine(seed, tied)
    names = sorted(_params(engine))
    audit = engine.address_audit
    live = kernel_tensors(engine.model, engine.updater.audited_extras())
    trace = [{"recorded": _record_view(audit.recorded, live)}]
    plan_names = sorted(_plan(engine, False).views)
    plan_shapes = {n: tuple(v.shape) for n, v in _plan(engine, False).views.items() if v is not None}
    for i, op in enumerate(ops):
        kind = op[0]
        try:
            ret = None
            if kind in ("rebind", "shrink", "retype"):
                p = engine.model.get_parameter(names[op[1] % len(names)])
                if kind == "rebind":
                    p.data = p.data.clone()
                elif kind == "shrink":
                    p.data = p.data[: max(1, p.shape[0] // 2)]
                else:
                    p.data = p.data.view(torch.int32)
            elif kind == "kv_clone":
                engine.model_runner.kv_cache = engine.model_runner.kv_cache.clone()
            elif kind == "check":
                only = None if op[1] is None else {x if isinstance(x, str) else names[x % len(names)] for x in op[1]}
                extra = {"engine": engine.updater.audited_extras(), "none": None, "empty": {}}[op[2]]
                ret = _lines(audit.violations(engine.model, extra, only=only))
            elif kind == "verify":
                engine.verify_addresses()
            elif kind == "update":
                gen = torch.Generator().manual_seed(seed * 1000 + i)
                ret = _scrub(engine.update_weights_from_tensor(named_tensors(plan_names, plan_shapes, op[1], gen)))
            else:
                raise ValueError(f"unknown operation {op!r}")
            entry = {"returned": ret}
        except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
            entry = {"raised": error_kind(exc)}
        entry["healthy"] = engine.updater.unhealthy is None
        trace.append(entry)
    return trace


def _record_view(recorded, live: dict) -> list:
    """What a record holds, compared with the tensors it was made from (no raw addresses)."""
    out = []
    for name, rec in recorded.items():
        t = live.get(name)
        storage = rec.storage
        out.append({
            "name": name, "shape": list(rec.shape) if isinstance(rec.shape, tuple) else repr(rec.shape),
            "shape_is_tuple": isinstance(rec.shape, tuple), "dtype": str(rec.dtype), "device": rec.device,
            "device_is_str": isinstance(rec.device, str),
            "data_ptr_is_the_tensors": t is not None and rec.data_ptr == t.data_ptr(),
            "holds_its_storage": (t is not None and storage is not None and hasattr(storage, "data_ptr")
                                  and storage.data_ptr() == t.untyped_storage().data_ptr()
                                  and storage.nbytes() == t.untyped_storage().nbytes()),
        })
    return out


def record_case(seed: int, specs: list, container: str) -> dict:
    """``AddressAudit(tensors)`` on tensors made from the seed: views into a few storages
    (offsets, transposes, columns, 0-d and empty tensors, several dtypes), or a refused input
    (``container`` "dict", "pairs" (a list of pairs), "none_value", "list_value").
    A spec is [storage index, view kind, dtype name]. Then the record is checked to keep the
    recorded memory: the tensors are dropped and new ones of the same sizes allocated; does any
    land at a recorded address?"""
    from course_lib.weights.commit.audit import AddressAudit
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(seed)
    bases = [torch.randn(int(torch.randint(8, 40, (1,), generator=gen)), int(torch.randint(4, 12, (1,), generator=gen)),
                         generator=gen) for _ in range(3)]
    views = {"whole": lambda b: b, "rows": lambda b: b[3:], "row": lambda b: b[2], "transposed": lambda b: b.t(),
             "column": lambda b: b[:, 1], "tail": lambda b: b.view(-1)[5:], "scalar": lambda b: b[1, 1],
             "empty": lambda b: b[:0], "clone": lambda b: b[1:].clone(), "fresh": lambda b: torch.zeros(b.shape[1])}
    tensors = {}
    for i, (k, view, dtype) in enumerate(specs):
        t = views[view](bases[k % len(bases)])
        if dtype != "float32":
            t = t.view(torch.int32) if dtype == "int32" and t.dim() and t.stride(-1) == 1 else t.to(DTYPES.get(dtype, torch.float64))
        tensors[f"t{i}.{view}"] = t
    if container == "pairs":
        arg = list(tensors.items())
    elif container in ("none_value", "list_value") and tensors:
        arg = dict(tensors)
        arg[list(arg)[len(arg) // 2]] = None if container == "none_value" else [1.0, 2.0]
    else:
        arg = tensors
    try:
        audit = AddressAudit(arg)
    except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
        return {"raised": error_kind(exc)}
    out = {"recorded": _record_view(audit.recorded, tensors)}
    ptrs = {rec.data_ptr for rec in audit.recorded.values() if rec.shape and 0 not in rec.shape}
    sizes = [t.untyped_storage().nbytes() for t in tensors.values()]
    del tensors, arg, bases  # freed at once (no cycles): only what the record holds stays allocated
    fresh = [torch.empty(n, dtype=torch.uint8) for n in sizes for _ in range(3)]
    out["a new tensor landed at a recorded address"] = any(f.data_ptr() in ptrs for f in fresh)
    return out
