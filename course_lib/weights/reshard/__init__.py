"""Resharding: move weights from the trainer's tensor-parallel layout to the engine's.

A *layout* says which region of a full tensor each rank holds: a block of rows, a block
of columns, everything (replicated), or any explicit box per rank. The trainer and the
engine rarely agree. The classic case: a 4x4 weight whose training ranks each hold two
columns, while each inference rank needs two rows. Row [1, 2, 3, 4] then lives half on
trainer rank 0 and half on trainer rank 1, so engine rank 0 must receive a piece from
each and put the pieces side by side.

- ``layouts.py``: boxes, ``Layout``, and the engine's, Megatron's and a transposed layout;
- ``planner.py``: ``plan`` intersects two layouts into pieces per rank; ``ReshardPlan``
  checks exact coverage and prints bytes per rank;
- ``executor.py``: trainer ranks ``send_pieces``, engine ranks ``receive_shards``;
- ``loading.py``: ``check_plan_matches`` and ``load_shards`` (through the layers' own
  loaders), the two calls the engine's update transaction makes around receiving.

Every public name is importable from here: ``from course_lib.weights.reshard import plan``.
"""
from course_lib.weights.reshard.executor import (DEFAULT_INFLIGHT_BYTES, check_locals, push_resharded,
                                                 read_trainer_locals, receive_shards, reshard_in_memory,
                                                 send_pieces, trainer_locals)
from course_lib.weights.reshard.layouts import (Box, Layout, ReshardError, box_shape, box_slices, engine_layout,
                                                engine_layouts, format_box, intersect, megatron_layouts, relative,
                                                transposed_layouts, volume)
from course_lib.weights.reshard.loading import check_plan_matches, load_shards
from course_lib.weights.reshard.planner import Piece, ReshardPlan, TensorPlan, plan, plan_for_model, plan_tensor

__all__ = ["Box", "DEFAULT_INFLIGHT_BYTES", "Layout", "Piece", "ReshardError", "ReshardPlan", "TensorPlan",
           "box_shape", "box_slices", "check_locals", "check_plan_matches", "engine_layout", "engine_layouts",
           "format_box", "intersect", "load_shards", "megatron_layouts", "plan", "plan_for_model", "plan_tensor",
           "push_resharded", "read_trainer_locals", "receive_shards", "relative", "reshard_in_memory", "send_pieces",
           "trainer_locals", "transposed_layouts", "volume"]
