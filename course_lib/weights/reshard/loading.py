"""An engine rank's side: check a plan against this model, and load received shards.

The engine's update transaction (pause rules, address audit, version, cache flush,
timings) is the engine's; it calls three functions of this package, in order:
``check_plan_matches(model, plan)`` before anything is received or written,
``executor.receive_shards(...)`` to receive this rank's shards (even when the update is
refused, so the trainers are not left hanging), and ``load_shards(model, shards)`` to
copy them in, through each parameter's own ``local_loader``.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch

from course_lib.models.qwen3 import hf_tensor_shapes
from course_lib.weights.reshard.layouts import ReshardError, engine_layout, format_box
from course_lib.weights.reshard.planner import ReshardPlan


def check_plan_matches(model, plan: ReshardPlan) -> None:
    """Refuse a plan whose engine layout is not this model's (wrong tp_size, a shard cut
    differently from what the loaders cut), before anything is received or written."""
    if plan.engine_world_size != model.tp_size:
        raise ReshardError(f"the plan is for {plan.engine_world_size} engine ranks; this engine has "
                           f"tensor_parallel_size {model.tp_size}")
    expected = hf_tensor_shapes(model.config)
    for name, t in plan.tensors.items():
        if name not in expected:
            raise ReshardError(f"{name}: matches no parameter of this model")
        if t.shape != tuple(expected[name]):
            raise ReshardError(f"{name}: plan shape {t.shape}, the model's is {tuple(expected[name])}")
        mine = engine_layout(model, name, t.shape).boxes[model.tp_rank]
        if t.dest.boxes[model.tp_rank] != mine:
            raise ReshardError(f"{name}: the plan gives engine rank {model.tp_rank} "
                               f"{format_box(t.dest.boxes[model.tp_rank])}, its loaders hold {format_box(mine)}")


def load_shards(model, shards: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> set[str]:
    """Copy checkpoint-format shards into this rank's parameters in place, through the
    model's own loaders (``load_local_weights``: each parameter's ``local_loader``): q/k/v
    and gate/up shards into their rows of the fused parameter, the rest whole; a quantized
    layer stages the shard, to be requantized by ``process_weights_after_loading``.
    Returns the names loaded; a shard of the wrong shape is a ReshardError naming it."""
    items = shards.items() if isinstance(shards, Mapping) else shards
    loaded = set()
    for name, shard in items:
        try:
            loaded |= model.load_local_weights([(name, shard)])
        except ValueError as exc:  # the loader's message names the parameter; add the tensor
            raise ReshardError(f"{name}: {exc}") from exc
    return loaded
