"""Remote seeding: a serving engine sends its weights to a newly started one.

A new replica usually reads its checkpoint from disk; when many start at once (scaling
out, replacing a failed node) the shared disk becomes the bottleneck, while a running
replica already holds the same weights in memory (SGLang's remote instance weight
loading). Here the running engine (the *source*) is rank 0 of a two-rank
``torch.distributed`` group and the new engine (the *target*, started with
``Engine(path, load_format="dummy")``: structure from config.json, random weights, not
ready) is rank 1. The exchange:

1. the source broadcasts a manifest: its config, weight version, and the bucket plan
   (names, dtypes, shapes per bucket); or an error if it cannot serve its weights;
2. the target checks the structure against its own and broadcasts a verdict back (so a
   refusal ends both sides at once instead of leaving the source blocked mid-send);
3. the source broadcasts each bucket (``dist.py``'s fixed buffers); the target loads each
   through its loaders, then post-processes and becomes ready.

The source sends checkpoint-format tensors read back from its parameters
(``get_weights_by_name``), which are exactly the checkpoint's values only when it is
unquantized and unsharded; a quantized or tensor-parallel source refuses in step 1.
"""
from __future__ import annotations

import json

import torch

from course_lib.config import ConfigError, ModelConfig
from course_lib.weights.checkpoint import hf_tensor_shapes
from course_lib.weights.transports import dist as dist_transport

DEFAULT_GROUP = "remote_seed"
_OK, _REFUSED = 0, 1


class WaitingForWeightsError(RuntimeError):
    """A request to an engine started with ``load_format="dummy"`` before its weights arrived."""
    retryable = True


class RemoteSeedError(RuntimeError):
    """The other side of a seeding exchange refused or could not take part."""


# ---- small messages over the group (a length, then JSON bytes) ----------------------------

def send_message(group, obj, root: int, device="cpu") -> None:
    """Broadcast a JSON-able object from ``root`` (device tensors for NCCL, CPU for gloo)."""
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(device)
    dist_transport.broadcast_async(group, torch.tensor([data.numel()], dtype=torch.int64, device=device), root).wait()
    dist_transport.broadcast_async(group, data, root).wait()


def receive_message(group, root: int, device="cpu"):
    n = torch.zeros(1, dtype=torch.int64, device=device)
    dist_transport.broadcast_async(group, n, root).wait()
    data = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    dist_transport.broadcast_async(group, data, root).wait()
    return json.loads(bytes(data.cpu().tolist()).decode())


# ---- the source's side ----------------------------------------------------------------------

def source_problem(engine) -> str | None:
    """Why ``engine`` cannot send checkpoint-exact weights, or None."""
    if engine.quantization is not None:
        return (f"the source engine is {engine.quantization}-quantized: it no longer holds the checkpoint's "
                f"floats (dequantizing gives different values), so it cannot seed an exact copy")
    if getattr(engine.model, "tp_size", 1) > 1:
        return "the source engine is one tensor-parallel rank and holds only a shard of each tensor"
    if getattr(engine, "waiting_for_weights", False):
        return "the source engine itself is still waiting for its weights"
    return None


def plan(config: ModelConfig, dtype: torch.dtype, bucket_bytes: int) -> list[dict]:
    """The buckets the source will send, described as ``dist.describe`` does. Shapes come
    from the config alone (meta tensors), so nothing is read to make the plan."""
    meta = [(n, torch.empty(s, dtype=dtype, device="meta")) for n, s in hf_tensor_shapes(config).items()]
    return [dist_transport.describe(group) for group in dist_transport.bucket_plan(meta, bucket_bytes)]


def send(engine, master_address: str, master_port: int, group_name: str = DEFAULT_GROUP,
         backend: str | None = None, bucket_bytes: int = dist_transport.DEFAULT_BUCKET_BYTES) -> dict:
    """Be rank 0 and send ``engine``'s weights; returns bytes, buckets and seconds."""
    device = torch.device(engine.config.device)
    backend = backend or ("nccl" if engine.config.is_cuda else "gloo")
    sender = dist_transport.WeightBroadcaster(master_address, master_port, 2, group_name, backend, device,
                                              bucket_bytes)
    try:
        problem = source_problem(engine)
        buckets = [] if problem else plan(engine.model_config, engine.config.dtype, bucket_bytes)
        manifest = {"error": problem, "config": engine.model_config.to_hf_dict(),
                    "weight_version": engine.weight_version, "buckets": buckets}
        send_message(sender.group, manifest, 0, device)
        verdict = receive_message(sender.group, 1, device)
        if problem:
            raise RemoteSeedError(problem)
        if verdict["status"] != _OK:
            raise RemoteSeedError(f"the new engine refused the weights: {verdict['reason']}")
        stats = {"buckets": 0, "bytes": 0, "seconds": 0.0}
        for request in buckets:
            rows = {n: s[0] for n, s in zip(request["names"], request["shapes"])}
            # One bucket of read-back tensors at a time: the source never holds a second model.
            tensors = [(n, engine.get_weights_by_name(n, truncate_size=rows[n])) for n in request["names"]]
            s = sender.broadcast(tensors, announce=lambda _: None)
            for k in stats:
                stats[k] += s[k]
        return stats
    finally:
        sender.close()


# ---- the target's side ----------------------------------------------------------------------

def check_manifest(manifest: dict, model_config: ModelConfig) -> str | None:
    """Why the target must refuse what the source offers, or None: the source's own error,
    a different structure, or tensors that are not exactly this model's."""
    if manifest.get("error"):
        return f"the source cannot send its weights: {manifest['error']}"
    try:
        source = ModelConfig.from_dict(dict(manifest["config"]))
    except (ConfigError, KeyError, TypeError) as exc:
        return f"the source's config is unreadable ({exc})"
    diff = model_config.structural_diff(source)
    if diff:
        fields = ", ".join(f"{k}: {b} at the source, {a} here" for k, (a, b) in diff.items())
        return f"the source's model has a different structure ({fields})"
    expected = hf_tensor_shapes(model_config)
    offered = {}
    for request in manifest.get("buckets", []):
        for name, dtype, shape in zip(request["names"], request["dtypes"], request["shapes"]):
            if name in offered:
                return f"the source sends {name} twice"
            offered[name] = (tuple(shape), dtype)
    if set(offered) != set(expected):
        odd = sorted(set(offered) ^ set(expected))
        return f"the source's tensors are not this model's ({len(odd)} differ, e.g. {odd[:3]})"
    for name, (shape, dtype) in offered.items():
        if shape != tuple(expected[name]) or dtype not in ("float32", "float16", "bfloat16"):
            return f"{name}: the source sends {shape} {dtype}, this model needs {tuple(expected[name])}"
    return None


def verdict(problem: str | None) -> dict:
    return {"status": _OK if problem is None else _REFUSED, "reason": problem}
