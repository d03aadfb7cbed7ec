"""Sources that arrive over a ``torch.distributed`` group: a trainer's broadcast, resharded
pieces, a seeding engine's weights.

A broadcast or resharded update is pushed by a sender that does not wait for the engine's
answer: when the engine refuses one (busy, invalid, or refused on another rank), it still
takes the bytes (``refused``) and drops them, so no sender is left hanging.

- ``BroadcastSource`` (SGLang's ``update_weights_from_distributed``): one broadcast per
  tensor, or all in one flattened bucket. An accepted bucket lands in the group's own
  receive buffer for its layout (``dist.ReceivePool``): from the second step on, one
  broadcast and one copy through the layout's cached table.
- ``ReshardSource``: this rank's pieces of a trainer's tensor-parallel layout
  (``weights/reshard/``), only what its shard needs, from whichever trainer ranks hold them.
- ``RemoteSource``: join a serving engine's seeding group as rank 1, check its manifest
  (a different structure is refused, and the source told, before any weight moves), then
  take its buckets as they come.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from course_lib.dtypes import DtypeError, parse_dtype, parse_dtypes
from course_lib.update.payload import unpack
from course_lib.update.port import UpdatePort
from course_lib.update.records import PhaseTimer, UpdatePlan
from course_lib.update.sources.base import UpdateSource
from course_lib.update.writers import check_bound, pick, tensor_candidates
from course_lib.weights.commit.validate import UpdateError, check_finite, validate_tensors
from course_lib.weights.reshard import check_plan_matches, receive_shards
from course_lib.weights.transports import dist as dist_transport
from course_lib.weights.transports import remote


@dataclass
class BroadcastSource(UpdateSource):
    """A trainer's broadcast (module docstring): the announced names, dtypes and shapes.
    ``plan.inputs``: the parsed dtypes."""
    names: list
    dtypes: list
    shapes: list
    group_name: str = "weight_update_group"
    load_format: str | None = None
    check_finite: bool = False
    kind = "broadcast"

    def parsed_dtypes(self) -> list:
        try:
            return parse_dtypes(self.dtypes)
        except DtypeError as exc:
            raise UpdateError(f"unknown dtype in {self.dtypes}: {exc}") from None

    def validate(self, port: UpdatePort, timer: PhaseTimer) -> UpdatePlan:
        port.transfers.group(self.group_name)  # ValueError when there is none
        dtypes = self.parsed_dtypes()
        if len(set(self.names)) != len(self.names):
            raise UpdateError("the update names a tensor more than once")
        meta = {n: (tuple(s), d) for n, s, d in zip(self.names, self.shapes, dtypes)}
        nbytes = validate_tensors(port.model_config, meta, partial=True)
        timer.lap("validate")
        candidates = tensor_candidates(port, self.names, chunk=True)
        if self.load_format == "flattened_bucket":
            pooled = port.parts.declined.get("receive_pool")
            if pooled is None and not port.transfers.buckets.enabled:
                pooled = "the bucket cache is switched off (BucketCache.enabled)"
            candidates.insert(0, ("receive_pool", pooled))
        writer, declined = pick(candidates)
        return UpdatePlan("broadcast", f"received {len(self.names)} tensors over {self.group_name!r}", writer,
                          nbytes, declined, dtypes)

    def receive(self, port: UpdatePort, dtypes) -> list:
        """The announced tensors, received into fresh memory."""
        group = port.transfers.group(self.group_name)
        if self.load_format == "flattened_bucket":  # all tensors in one byte buffer
            return dist_transport.receive_bucket(group, self.names, dtypes, self.shapes, port.device)
        pairs = []  # one broadcast per tensor (SGLang's default)
        for n, d, shape in zip(self.names, dtypes, self.shapes):
            t = torch.empty(tuple(shape), dtype=d, device=port.device)
            dist_transport.broadcast_async(group, t).wait()
            pairs.append((n, t))
        return pairs

    def fetch(self, port: UpdatePort, plan: UpdatePlan, timer: PhaseTimer):
        if plan.writer != "receive_pool":
            pairs = self.receive(port, plan.inputs)
            timer.lap("transfer")
            if self.check_finite:
                check_finite(pairs)
            return plan, pairs
        slot, flat, metadata = port.transfers.receive_pooled(self.group_name, self.names, plan.inputs, self.shapes)
        timer.lap("transfer")
        pool = port.transfers.receive_pool(self.group_name)
        payload = {"flattened_tensor": flat, "metadata": metadata}
        found = port.transfers.buckets.lookup(port.model, payload, resident=True)
        if isinstance(found, str):  # no table for it: the general path over views of the buffer
            pairs = unpack(payload)
            if self.check_finite:
                check_finite(pairs)
            return replace(plan, declined={**plan.declined, "cached_bucket": found}), (None, pairs, pool, slot)
        check_bound(port, found, self.check_finite)
        timer.lap("validate")
        return plan, (found, None, pool, slot)

    def refused(self, port: UpdatePort, refusal: BaseException) -> None:
        try:
            self.receive(port, self.parsed_dtypes())
        except (ValueError, RuntimeError):  # no group, or an announcement nobody can receive: nothing arrives
            pass


@dataclass
class ReshardSource(UpdateSource):
    """This rank's pieces of a resharded update (module docstring). Adds ``received_bytes``
    and ``pieces`` to the result."""
    plan: object
    group_name: str = "weight_update_group"
    trainer_group_ranks: object = None
    engine_group_ranks: object = None
    kind = "reshard"

    def validate(self, port: UpdatePort, timer: PhaseTimer) -> UpdatePlan:
        port.transfers.group(self.group_name)  # ValueError when there is none
        check_plan_matches(port.model, self.plan)
        timer.lap("validate")
        return UpdatePlan("reshard", "resharded", "reshard", chunk=False)

    def receive(self, port: UpdatePort) -> dict:
        return receive_shards(self.plan, port.tp_rank, port.transfers.group(self.group_name), port.device,
                              self.trainer_group_ranks, self.engine_group_ranks)

    def fetch(self, port: UpdatePort, plan: UpdatePlan, timer: PhaseTimer):
        shards = self.receive(port)
        timer.lap("transfer")
        nbytes = sum(t.numel() * t.element_size() for t in shards.values())
        fields = {"received_bytes": nbytes, "pieces": len(self.plan.pieces_for(port.tp_rank))}
        return replace(plan, message=f"resharded {len(shards)} tensors into rank {port.tp_rank}", nbytes=nbytes,
                       fields=fields), shards

    def refused(self, port: UpdatePort, refusal: BaseException) -> None:
        try:
            self.receive(port)
        except (ValueError, RuntimeError):
            pass


@dataclass
class RemoteSource(UpdateSource):
    """A seeding engine's weights (module docstring). The version label defaults to the
    source's; the engine is ready afterwards (``load_format="dummy"`` engines wait for this)."""
    master_address: str
    master_port: int
    group_name: str = "remote_seed"
    backend: str | None = None
    timeout_s: float = 300.0
    kind = "remote"

    def validate(self, port: UpdatePort, timer: PhaseTimer) -> UpdatePlan:
        if port.sharded:
            raise UpdateError("remote seeding is not supported on a tensor-parallel rank: this rank holds only a "
                              "shard of each tensor, so it cannot rebuild or send checkpoint tensors")
        return UpdatePlan("remote", f"seeded from {self.master_address}:{self.master_port}", "remote", complete=True)

    def fetch(self, port: UpdatePort, plan: UpdatePlan, timer: PhaseTimer):
        device = torch.device(port.device)
        backend = self.backend or ("nccl" if port.is_cuda else "gloo")
        group, _store = dist_transport.new_group(self.master_address, self.master_port, 1, 2, self.group_name,
                                                 backend, self.timeout_s)
        manifest = remote.receive_message(group, 0, device)
        problem = remote.check_manifest(manifest, port.model_config)
        remote.send_message(group, remote.verdict(problem), 1, device)
        if problem:
            raise UpdateError(f"remote seeding refused: {problem}")
        buckets = manifest["buckets"]
        nbytes = sum(torch.Size(s).numel() * parse_dtype(d).itemsize
                     for b in buckets for d, s in zip(b["dtypes"], b["shapes"]))
        timer.lap("handshake")
        message = (f"seeded {sum(len(b['names']) for b in buckets)} tensors from "
                   f"{self.master_address}:{self.master_port}")
        return replace(plan, message=message, nbytes=nbytes, default_version=manifest["weight_version"]), \
            (group, buckets)
