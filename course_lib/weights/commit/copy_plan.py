"""A copy plan: where each checkpoint tensor lands in the model's memory, worked out once.

The general load path (``model.load_weights``) maps each checkpoint name, finds the
parameter and calls its loader, which checks the shape and narrows the fused parameter:
for every tensor of every update. In an unquantized model on one rank none of that
changes between updates (the address audit guarantees the memory stays put), so the plan
records, per checkpoint name, the view of the model's memory it fills: the parameter
itself, or a ``narrow`` of the fused ``qkv_proj`` / ``gate_up_proj`` rows. Applying
tensors is then a dictionary lookup each, a ``copy_`` per large tensor and one grouped
copy (``torch._foreach_copy_``: many tensors per kernel launch) for the small ones.

Quantized layers (the weight must be requantized) and tensor-parallel ranks (the
incoming tensor must be sliced) keep the general path: ``CopyPlan.for_model`` says None.
So does ``COURSE_LIB_COPY_PLAN=0`` in the environment, to compare the two paths.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from course_lib import settings
from course_lib.exercises import is_written
from course_lib.weights.checkpoint import hf_tensor_shapes


COMMIT_STEP = "ch04.copy_in_place"  # the exercise ``CopyPlan.apply`` holds: the commit step
SMALL_COPY_BYTES = 1 << 20  # below this, tensors are copied together in one grouped call


def checkpoint_view(model: nn.Module, name: str) -> torch.Tensor | None:
    """The view of ``model``'s memory that checkpoint tensor ``name`` fills (one rank,
    unquantized), or None when the model keeps no separate copy (a tied ``lm_head``)."""
    target = model.map_checkpoint_name(name)
    if target is None:
        return None
    param_name, shard_id = target
    owner, _, attr = param_name.rpartition(".")
    module = model.get_submodule(owner)
    data = getattr(module, attr).data  # the storage kernels (and captured graphs) read
    if shard_id is None:
        return data
    return data.narrow(0, *module.shard_rows(shard_id))  # rows of a row-major weight: a contiguous view


class CopyPlan:
    """Per checkpoint name, the view of the model's memory that tensor fills (``views``);
    ``apply`` is the commit step that copies an update's tensors into those views."""

    def __init__(self, model: nn.Module):
        self.views = {name: checkpoint_view(model, name) for name in hf_tensor_shapes(model.config)}

    @classmethod
    def from_views(cls, views: dict) -> "CopyPlan":
        """A plan over given views ({key: the tensor to write}): how a registered update
        hands its pieces to the commit step (``copy_table.RegisteredTable.commit_step``)."""
        plan = cls.__new__(cls)
        plan.views = views
        return plan

    @staticmethod
    def for_model(model: nn.Module) -> "CopyPlan | None":
        """The model's plan (made on first use, then kept), or None where the general
        loaders must run (quantized layers, tensor-parallel ranks)."""
        if getattr(model, "quantization", None) is not None or getattr(model, "tp_size", 1) != 1:
            return None
        if not settings.copy_plan():
            return None
        plan = model.__dict__.get("_copy_plan")
        if plan is None:
            plan = model.__dict__["_copy_plan"] = CopyPlan(model)
        return plan

    def apply(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each (checkpoint name, tensor) pair into its view, in place: the commit step.

        ``self.views[name]`` is the tensor to write (the memory kernels and captured CUDA
        graphs read: a parameter's ``.data`` or a ``narrow`` of a fused one), or None for
        a name the model keeps no separate copy of (a tied ``lm_head.weight``: skip it).
        ``named_tensors`` may be any iterable (a generator too: read it once); tensors
        may be on another device or in another floating dtype than their views.

        Promises: every view afterwards holds its tensor's values, converted to the view's
        dtype, in the same memory (no view, parameter or storage is ever replaced). No
        tensor is staged on the way (no copy of it, converted or not, is allocated), and on
        a GPU the copies may still be running when it returns: the caller synchronizes
        once, after the whole update. It runs on every update, so its speed matters: the
        chapter's speed part times it on a GPU beside the reference's and a plain device copy.

        Errors, raised before anything is written (a refused update changes nothing):
        a name with no entry in ``views``: KeyError naming it; a tensor whose shape is
        not exactly its view's (a broadcastable or same-size shape included): ValueError
        naming the tensor, its shape and the expected shape.
        """
        # BEGIN EXERCISE ch04.copy_in_place
        grouped: dict[tuple, tuple[list, list]] = {}
        for name, t in named_tensors:  # check everything before the first write
            if name not in self.views:
                raise KeyError(f"checkpoint tensor {name!r} matches no parameter of this model")
            view = self.views[name]
            if view is None:  # tied to the embedding: written through that name
                continue
            if view.shape != t.shape:
                raise ValueError(f"{name}: checkpoint tensor has shape {tuple(t.shape)}, expected {tuple(view.shape)}")
            dsts, srcs = grouped.setdefault((t.device, t.dtype), ([], []))
            dsts.append(view)
            srcs.append(t)
        for (device, _), (dsts, srcs) in grouped.items():
            if device != dsts[0].device:  # host to device: one copy each, straight into the weights
                for dst, src in zip(dsts, srcs):
                    dst.copy_(src, non_blocking=True)
                continue
            # Same device: a large tensor's own copy_ runs at the copy engine's rate (a grouped
            # copy of large tensors reached ~55% of it on an H200); the many small ones (norms)
            # go in one grouped call, where a launch each would cost more than their bytes.
            small = [i for i, d in enumerate(dsts) if d.numel() * d.element_size() < SMALL_COPY_BYTES]
            if small:
                torch._foreach_copy_([dsts[i] for i in small], [srcs[i] for i in small])
            for dst, src in zip(dsts, srcs):
                if dst.numel() * dst.element_size() >= SMALL_COPY_BYTES:
                    dst.copy_(src, non_blocking=True)
        # END EXERCISE


def copy_in_place(model, named_tensors, device) -> None:
    """The commit step, decided at each call: copy validated (name, tensor) pairs into the
    live parameters, in place (never rebinding one): through the model's copy plan where
    it has one (unquantized, one rank) and its part is written, else through its loaders
    (fusion, TP slicing, staging for requantization). On GPU the copies may still be
    running when it returns. An engine decides this once (``update/port.py``'s
    ``engine_commit_step``); this function is for code that commits outside an engine."""
    plan = CopyPlan.for_model(model)
    # The student edition before chapter 04: the plan's commit step is unwritten, so the
    # loaders commit instead (the part is switched off, never routed around once written).
    if plan is not None and is_written(CopyPlan.apply, COMMIT_STEP):
        plan.apply(named_tensors)  # copies from wherever the tensors are, straight into the weights
        return
    model.load_weights((name, t.to(device, non_blocking=True)) for name, t in named_tensors)


def read_checkpoint_tensor(model: nn.Module, name: str, truncate_size: int = 100) -> torch.Tensor:
    """The current values of checkpoint tensor ``name`` (its first ``truncate_size`` rows),
    read back out of the model's fused, sharded or quantized parameters (dequantized for
    int8 / FP8; this rank's shard under tensor parallelism), as a new tensor. Raises
    ``KeyError`` for a name the model does not have."""
    if name == "lm_head.weight" and model.config.tie_word_embeddings:
        name = "model.embed_tokens.weight"
    target = model.map_checkpoint_name(name)
    if target is None:
        raise KeyError(f"{name!r} is not a weight of this model")
    param_name, shard_id = target
    module = model.get_submodule(param_name.rsplit(".", 1)[0])
    method = getattr(module, "quant_method", None)
    full = method.dequantized_weight(module) if hasattr(method, "dequantized_weight") else module.weight
    if shard_id is not None:                   # its rows of a fused q/k/v or gate/up weight
        full = full.narrow(0, *module.shard_rows(shard_id))
    return full[:truncate_size].detach().clone()
