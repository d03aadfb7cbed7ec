"""Update sources: validate what an update brings and say how to write it.

Each function here takes what one transport delivers (a checkpoint dir, tensors in
memory, a trainer's broadcast, resharded pieces, a sparse payload, a seeding engine's
buckets), checks it against the model before anything live changes, and returns a
``ValidatedUpdate`` whose ``apply`` step writes it in place. The engine's public
``update_weights_*`` methods (``updates.py``) hand that to the transaction.

The in-place write itself is ``copy_in_place`` (``weights/update.py``), looked up here
at call time, so ``course_lib.testing.plugged_commit`` can put a learner's version in.
"""
from __future__ import annotations

import contextlib

import torch

from course_lib.layers import direct_quant
from course_lib.layers.quant import QuantizedLinearMethod, discard_staged_weights, process_weights_after_loading
from course_lib.engine.transaction import Applied, ValidatedUpdate, receive_even_if_refused
from course_lib.weights import bucket, safe_pickle
from course_lib.weights import update as weights_update
from course_lib.weights.checkpoint import hf_tensor_shapes
from course_lib.weights.layerwise import LayerwiseReload
from course_lib.weights.rollback import GuardedLayerwiseReload, RollbackPoint
from course_lib.weights.reshard import check_plan_matches, load_shards, receive_shards
from course_lib.weights.transports import dist as dist_transport
from course_lib.weights.transports import remote, sparse
from course_lib.weights.update import (PhaseTimer, UpdateError, check_finite, copy_in_place, open_and_validate,
                                       stage_from_disk, validate_tensors)


def decode_tensor_payload(payload, load_format: str | None, tp_rank: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Turn whatever ``update_weights_from_tensor`` was given into (name, tensor) pairs."""
    if load_format not in (None, "flattened_bucket", "direct"):
        raise UpdateError(f"unknown load_format {load_format!r}; expected None or 'flattened_bucket'")
    if isinstance(payload, list) and payload and all(isinstance(p, (str, bytes)) for p in payload):
        if tp_rank >= len(payload):
            raise UpdateError(f"payload has {len(payload)} per-rank entries; this engine is rank {tp_rank}")
        payload = payload[tp_rank]
    if isinstance(payload, (str, bytes)):
        payload = safe_pickle.deserialize(payload)  # raises UnsafePickleError (a ValueError)
    if load_format == "flattened_bucket":
        try:
            return bucket.unpack(payload)
        except bucket.BucketError as exc:
            raise UpdateError(f"bad flattened bucket: {exc}") from exc
    if isinstance(payload, dict):
        payload = list(payload.items())
    if not isinstance(payload, (list, tuple)):
        raise UpdateError(f"expected (name, tensor) pairs, got {type(payload).__name__}")
    pairs = []
    for item in payload:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise UpdateError("every entry must be a (name, tensor) pair")
        pairs.append((item[0], item[1]))
    return pairs


# ---- apply steps ----------------------------------------------------------------------------

def requantized(model, name: str) -> bool:
    """Whether checkpoint tensor ``name`` lands in a quantized layer (requantized on arrival)."""
    target = model.map_checkpoint_name(name)
    if target is None:
        return False
    module = model.get_submodule(target[0].rpartition(".")[0])
    return isinstance(getattr(module, "quant_method", None), QuantizedLinearMethod)


def chunk_applier(engine, named_tensors, allow_pending: bool):
    """Apply validated tensors that are all in hand: copy in place, then requantize
    (layers still waiting for shards stay staged when ``allow_pending``). A quantized
    engine on one rank requantizes straight into its kernel tensors where
    ``layers/direct_quant.py`` may (the same bits, less than half the memory traffic), unless
    a learner's commit step is plugged in (``testing.plugged_commit``): that one runs."""
    def written() -> Applied:
        # Only the parameters this chunk wrote need auditing now (the full audit runs when
        # generation resumes): cheaper than walking every module after each chunk.
        targets = map(engine.model.map_checkpoint_name, (n for n, _ in named_tensors))
        return Applied(audit_only={t[0] for t in targets if t})

    def apply(timer: PhaseTimer) -> Applied:
        if (engine.config.quantization is not None and copy_in_place is weights_update.copy_in_place
                and direct_quant.apply(engine.model, named_tensors, engine.config.device, allow_pending)):
            if engine.config.is_cuda:
                torch.cuda.synchronize()
            timer.lap("copy")
            # The direct path wrote the quantized layers through views of the qweight and
            # weight_scale they hold now (it never rebinds); the rest went through the loaders.
            return written()
        if engine.config.quantization is not None:
            # A quantizer refuses NaN and inf, but only once it reaches that layer, after
            # earlier layers (and the norms) were written: refuse them before any write.
            check_finite([(n, t) for n, t in named_tensors if requantized(engine.model, n)])
        copy_in_place(engine.model, named_tensors, engine.config.device)
        if engine.config.is_cuda:
            torch.cuda.synchronize()
        timer.lap("copy")
        if engine.config.quantization is None:
            return written()  # checkpoint format is kernel format: nothing to post-process
        process_weights_after_loading(engine.model, allow_pending=allow_pending)
        timer.lap("post_process")
        return Applied()
    return apply


def layerwise_applier(engine, reader, names, use_snapshot: bool):
    """Stream a checkpoint one decoder layer at a time (``weights/layerwise.py``), each
    layer checked (finite values) before it is written and saved to a rollback point
    (``weights/rollback.py``) just before; a fault midway puts the written layers back
    (from the rollback point, or from the full snapshot when ``use_snapshot``).
    On a GPU the tensors are read in parallel into pinned buffers and arrive on the GPU
    (``weights/pinned_reader.py``), reads overlapping the transfers and the writes."""
    def apply(timer: PhaseTimer) -> Applied:
        rollback = None if use_snapshot else RollbackPoint(engine.model)
        reload = GuardedLayerwiseReload(engine.model, names, engine.config.device, rollback)
        device = engine.config.device if engine.config.is_cuda else "cpu"
        try:
            # closing: on a fault the reader stops at once (its threads joined, its file closed)
            with contextlib.closing(reader.iter_tensors(names, device=device)) as tensors:
                for name, tensor in tensors:
                    reload.feed(name, tensor)
                    del tensor  # its memory is free for the next tensor: one layer held at a time
            memory = reload.finish()
        except Exception as exc:
            engine._after_midstream_fault(reload.applied, exc, rollback)
        finally:
            if rollback is not None:
                rollback.release()
        # Host memory: freed now on a CPU; on a GPU the pinned copy is kept for the next update.
        memory["rollback_peak_bytes"] = reload.peak_rollback_bytes
        wall = timer.ms_since_lap()
        timer.ms.update({k: v for k, v in reload.ms.items() if k != "transfer"})
        timer.ms["transfer"] = max(0.0, wall - reload.ms["copy"] - reload.ms["post_process"])  # reading + H2D
        timer.lap(None)
        return Applied(fields={"memory": memory})
    return apply


def with_runtime_config(engine, new, apply):
    """``apply``, then the runtime config fields (after every weight is written: a refused
    update changes neither)."""
    def apply_all(timer: PhaseTimer) -> Applied:
        applied = apply(timer)
        changed = engine._apply_runtime_config(new)
        if changed:
            applied.fields["config_applied"] = changed
        return applied
    return apply_all


# ---- sources ----------------------------------------------------------------------------------

def disk_update(engine, model_path, partial: bool, staging: str, keep_snapshot: bool) -> ValidatedUpdate:
    """A checkpoint dir, validated whole from its headers; streamed per layer or staged."""
    timer = PhaseTimer()
    reader, nbytes = open_and_validate(engine.model_config, model_path, partial)
    names = list(reader.metadata())
    timer.lap("validate")
    if staging == "full" or not LayerwiseReload.is_written():
        staged = stage_from_disk(reader)
        check_finite(staged.items())
        timer.lap("transfer")
        apply = chunk_applier(engine, staged.items(), allow_pending=False)
    else:
        apply = layerwise_applier(engine, reader, names, use_snapshot=keep_snapshot)
    if keep_snapshot:
        engine.take_snapshot()
        timer.lap("snapshot")
    apply = with_runtime_config(engine, reader.config, apply)
    return ValidatedUpdate(apply, nbytes, f"updated from {reader.path}", timer)


def tensor_update(engine, payload, load_format, refuse_non_finite: bool) -> ValidatedUpdate | None:
    """Tensors handed over in memory (pairs, a dict, a flattened bucket, or serialized);
    None for an empty chunk."""
    timer = PhaseTimer()
    tensors = decode_tensor_payload(payload, load_format, tp_rank=engine.config.tp_rank)
    if tensors and tensors[0][1].is_cuda:
        engine._keep_ipc_buffer(tensors[0][1])
    timer.lap("deserialize")
    if not tensors:
        return None
    meta = {name: (tuple(t.shape), t.dtype) for name, t in tensors}
    if len(meta) != len(tensors):
        raise UpdateError("the update names a tensor more than once")
    nbytes = validate_tensors(engine.model_config, meta, partial=True)
    if refuse_non_finite:
        check_finite(tensors)
    timer.lap("validate")
    return ValidatedUpdate(chunk_applier(engine, tensors, allow_pending=True), nbytes,
                           f"updated {len(tensors)} tensors", timer)


def parse_dtypes(dtypes) -> list[torch.dtype]:
    """torch dtypes from names ("bfloat16", "torch.float32") or dtypes; UpdateError if unknown."""
    try:
        parsed = [getattr(torch, str(d).removeprefix("torch.")) for d in dtypes]
    except AttributeError:
        parsed = [None]
    if not all(isinstance(d, torch.dtype) for d in parsed):
        raise UpdateError(f"unknown dtype in {dtypes}")
    return parsed


def broadcast_update(engine, group_name, names, dtypes, shapes, load_format, refuse_non_finite: bool,
                     abort_all_requests: bool, refuse_with: str | None) -> ValidatedUpdate:
    """A trainer's broadcast over a weight-update group, received even when refused."""
    group = engine._weight_group(group_name)
    timer = PhaseTimer()
    dtypes = parse_dtypes(dtypes)

    def check() -> int:
        if refuse_with is not None:
            raise UpdateError(refuse_with)
        engine._refuse_if_busy(abort_all_requests)
        if len(set(names)) != len(names):
            raise UpdateError("the update names a tensor more than once")
        meta = {n: (tuple(s), d) for n, s, d in zip(names, shapes, dtypes)}
        nbytes = validate_tensors(engine.model_config, meta, partial=True)
        timer.lap("validate")
        return nbytes

    def receive(_refusal):
        device = engine.config.device
        if load_format == "flattened_bucket":  # all tensors in one byte buffer
            tensors = dist_transport.receive_bucket(group, names, dtypes, shapes, device)
        else:  # one broadcast per tensor (SGLang's default)
            tensors = []
            for n, d, shape in zip(names, dtypes, shapes):
                t = torch.empty(tuple(shape), dtype=d, device=device)
                dist_transport.broadcast_async(group, t).wait()
                tensors.append((n, t))
        timer.lap("transfer")
        return tensors
    nbytes, tensors = receive_even_if_refused(check, receive)
    if refuse_non_finite:
        check_finite(tensors)
    return ValidatedUpdate(chunk_applier(engine, tensors, allow_pending=True), nbytes,
                           f"received {len(tensors)} tensors over {group_name!r}", timer)


def resharded_update(engine, plan, group_name, abort_all_requests: bool, refuse_with: str | None,
                     trainer_group_ranks, engine_group_ranks) -> ValidatedUpdate:
    """This rank's pieces of a resharded update (``weights/reshard.py``), received even
    when refused (busy, or a plan that does not match this rank's loaders)."""
    group = engine._weight_group(group_name)
    timer = PhaseTimer()
    rank = engine.config.tp_rank

    def check() -> None:
        if refuse_with is not None:
            raise UpdateError(refuse_with)
        engine._refuse_if_busy(abort_all_requests)
        check_plan_matches(engine.model, plan)
        timer.lap("validate")

    def receive(_refusal):
        shards = receive_shards(plan, rank, group, engine.config.device, trainer_group_ranks, engine_group_ranks)
        timer.lap("transfer")
        return shards
    _, shards = receive_even_if_refused(check, receive)
    nbytes = sum(t.numel() * t.element_size() for t in shards.values())

    def apply(timer: PhaseTimer) -> Applied:
        load_shards(engine.model, shards)
        timer.lap("copy")
        process_weights_after_loading(engine.model, allow_pending=False)
        timer.lap("post_process")
        return Applied(fields={"received_bytes": nbytes, "pieces": len(plan.pieces_for(rank))})
    return ValidatedUpdate(apply, nbytes, f"resharded {len(shards)} tensors into rank {rank}", timer)


def sparse_update(engine, payload: dict) -> ValidatedUpdate | None:
    """Only changed elements, in checkpoint coordinates (``transports/sparse.py``): each
    touched tensor is rebuilt from the engine's current values with the new elements
    scattered in; None for an empty payload."""
    timer = PhaseTimer()
    try:
        entries = sparse.validate(payload, hf_tensor_shapes(engine.model_config))
    except sparse.SparsePayloadError as exc:
        raise UpdateError(f"bad sparse payload: {exc}") from exc
    timer.lap("validate")
    if not entries:
        return None
    rebuilt = []
    for (name, shape, _), idx, values in zip(entries, payload["indices"], payload["values"]):
        # All rows: exactly the checkpoint tensor as the engine holds it (unquantized).
        current = engine.get_weights_by_name(name, truncate_size=shape[0])
        rebuilt.append((name, sparse.scatter(current, idx, values)))
    timer.lap("rebuild")
    n = sparse.num_elements(payload)
    return ValidatedUpdate(chunk_applier(engine, rebuilt, allow_pending=True), sparse.payload_nbytes(payload),
                           f"sparse update of {n} elements in {len(entries)} tensors", timer,
                           fields={"dense_bytes": sparse.dense_nbytes(payload), "elements": n})


def remote_update(engine, master_address: str, master_port: int, group_name: str, backend: str | None,
                  timeout_s: float) -> tuple[ValidatedUpdate, str]:
    """Join a seeding engine's group as rank 1 and check its manifest (a source with a
    different structure is refused, and told, before any bytes move); the apply step
    receives and loads the buckets. Returns the update and the source's version."""
    timer = PhaseTimer()
    device = torch.device(engine.config.device)
    backend = backend or ("nccl" if engine.config.is_cuda else "gloo")
    group, _store = dist_transport.new_group(master_address, master_port, 1, 2, group_name, backend, timeout_s)
    manifest = remote.receive_message(group, 0, device)
    problem = remote.check_manifest(manifest, engine.model_config)
    remote.send_message(group, remote.verdict(problem), 1, device)
    if problem:
        raise UpdateError(f"remote seeding refused: {problem}")
    buckets = manifest["buckets"]
    nbytes = sum(torch.Size(s).numel() * getattr(torch, d).itemsize
                 for b in buckets for d, s in zip(b["dtypes"], b["shapes"]))
    timer.lap("handshake")

    def apply(timer: PhaseTimer) -> Applied:
        try:
            for request in buckets:
                tensors = dist_transport.receive_bucket(group, request["names"], request["dtypes"],
                                                        request["shapes"], engine.config.device)
                timer.lap("transfer")
                chunk_applier(engine, tensors, allow_pending=True)(timer)  # a fused layer may span buckets
            process_weights_after_loading(engine.model)  # every layer complete now, or refused
        except Exception as exc:
            discard_staged_weights(engine.model)
            if not engine.waiting_for_weights:  # a serving engine now holds a mix of two versions
                engine.unhealthy = f"remote seeding failed midway ({exc}); the weights are a mix of two versions"
            raise UpdateError(f"remote seeding failed midway: {exc}") from exc
        timer.lap("post_process")
        return Applied()
    message = f"seeded {sum(len(b['names']) for b in buckets)} tensors from {master_address}:{master_port}"
    return ValidatedUpdate(apply, nbytes, message, timer), manifest["weight_version"]
