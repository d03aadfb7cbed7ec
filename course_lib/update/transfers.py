"""What transports keep between updates: weight-update groups, registered buffers, and the
buffers a trainer recently handed over in flattened buckets.

``Transfers`` holds that state for the ``Updater``; it writes no weight. The groups are
``torch.distributed`` groups a trainer broadcasts on (``init_weights_update_group``); the
``Registration`` is a trainer's reusable buffers and layout, validated once
(``weights/commit/copy_table.py``). Flattened buckets: ``buckets`` (``weights/commit/bucket_cache.py``)
keeps each bucket layout validated once and, per trainer buffer, the copy table built for
it, holding the buffer mapped, so a trainer that reuses its buffers step after step costs
one handle opening per buffer, not one per bucket or per step; the IPC keep-alive maps the
last few buffers of buckets that take the general path. Broadcast buckets: each group has
its receive buffers (``dist.ReceivePool``), kept until the group is destroyed, which the
bucket cache treats as buffers seen before (one copy table per announced layout).
"""
from __future__ import annotations

import collections

import torch

from course_lib.update.records import Registration
from course_lib.weights.commit import copy_table
from course_lib.weights.commit.bucket_cache import BucketCache
from course_lib.weights.commit.validate import UpdateError
from course_lib.weights.transports import dist as dist_transport
from course_lib.weights.transports import safe_pickle


class Transfers:
    """Groups, the registration and the IPC keep-alive of one engine rank."""

    def __init__(self, device: str, tp_rank: int = 0):
        self.device = device
        self.tp_rank = tp_rank
        self.groups: dict = {}                              # name -> (group, store)
        self.receive_pools: dict[str, dist_transport.ReceivePool] = {}  # name -> its receive buffers
        self.registration = Registration()                  # epoch 0: nothing registered
        self.ipc_keepalive = collections.deque(maxlen=4)    # recently received CUDA IPC storages
        self.buckets = BucketCache(device)                  # flattened-bucket layouts and copy tables

    # ---- CUDA IPC buffers -------------------------------------------------------------------
    def keep_ipc_buffer(self, tensor: torch.Tensor) -> None:
        self.ipc_keepalive.append(tensor.untyped_storage())

    def release(self) -> None:
        """At resume, on a GPU: unmap the general path's buffers, and the cached buffers the
        trainer did not use since the previous resume (those it reuses stay mapped)."""
        self.ipc_keepalive.clear()
        self.buckets.release()

    # ---- weight-update groups ---------------------------------------------------------------
    def group(self, group_name: str):
        if group_name not in self.groups:
            raise ValueError(f"no weight-update group named {group_name!r}; call init_weights_update_group first")
        return self.groups[group_name][0]

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str = "weight_update_group", backend: str | None = None) -> dict:
        """Join the trainer's weight-update group as rank ``rank_offset + tp_rank`` (blocks
        until every rank has joined). ``backend``: "nccl" on GPU, "gloo" on CPU by default."""
        if group_name in self.groups:
            raise ValueError(f"weight-update group {group_name!r} already exists; destroy it first")
        backend = backend or ("nccl" if torch.device(self.device).type == "cuda" else "gloo")
        rank = rank_offset + self.tp_rank
        self.groups[group_name] = dist_transport.new_group(master_address, master_port, rank, world_size,
                                                           group_name, backend)
        return {"success": True, "message": f"joined {group_name!r} as rank {rank} of {world_size} ({backend})"}

    def destroy_group(self, group_name: str = "weight_update_group") -> dict:
        if self.groups.pop(group_name, None) is None:
            raise ValueError(f"no weight-update group named {group_name!r}")
        pool = self.receive_pools.pop(group_name, None)
        if pool is not None:
            self.buckets.forget(pool.clear())  # the receive buffers' memory goes back
        return {"success": True, "message": f"destroyed {group_name!r}"}

    def receive_pool(self, group_name: str) -> dist_transport.ReceivePool:
        """Group ``group_name``'s receive buffers (made at its first bucket)."""
        pool = self.receive_pools.get(group_name)
        if pool is None:
            pool = self.receive_pools[group_name] = dist_transport.ReceivePool(self.device)
        return pool

    def receive_pooled(self, group_name: str, names, dtypes, shapes):
        """Receive this announcement's flattened bucket into the group's buffer for its
        layout (``dist.ReceivePool``): ``(slot, flat, metadata)``."""
        pool = self.receive_pool(group_name)
        slot, flat, metadata, replaced = pool.buffer_for(names, dtypes, shapes)
        if replaced is not None:
            self.buckets.forget([replaced])
        pool.receive(self.group(group_name), slot, flat)
        return slot, flat, metadata

    # ---- registered buffers -----------------------------------------------------------------
    def register(self, model, payload, partial: bool = False, copy_mode: str | None = None) -> dict:
        """Map a trainer's reusable buffers and validate its whole layout once; replaces an
        earlier registration. Returns the new ``epoch`` (see ``Updater.register_weight_buffers``)."""
        try:
            if isinstance(payload, (str, bytes)):
                payload = safe_pickle.deserialize(payload)
            table = copy_table.RegisteredTable.build(model, payload, self.device, partial)
            mode = copy_table.copy_mode(self.device, copy_mode)
            table.prepare(mode)
        except copy_table.RegistrationError as exc:
            raise UpdateError(f"registration refused: {exc}") from exc
        self.registration = Registration(self.registration.epoch + 1, table, mode)
        return {"success": True, "epoch": self.registration.epoch, "buckets": table.num_buckets,
                "tensors": len(table.names), "bytes": sum(table.nbytes), "copy_mode": mode}

    def unregister(self) -> dict:
        """Forget the registration (unmap the trainer's buffers)."""
        old = self.registration
        self.registration = Registration(old.epoch)
        return {"success": True,
                "message": "no registration to drop" if old.table is None else f"dropped epoch {old.epoch}"}
