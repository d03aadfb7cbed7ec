"""Support for find-the-rebind: a CPU stand-in for a captured decode graph, and the plug
that makes a learner's ``load_into`` the engine's commit step (``course_lib.testing.plugged_commit``).

``capture_decode(engine)``: from then on the engine's decode steps read the storage each
kernel-read tensor had at that moment (second handles to the same storage, swapped in
with ``torch.func.functional_call``), as a replayed CUDA graph reads the addresses it
recorded. ``param.data = new`` is invisible to it; ``param.data.copy_(new)`` is not.
Prefill stays eager, as on a GPU.
"""
from __future__ import annotations

import torch
from torch.func import functional_call

from course_lib.testing import plugged_commit  # noqa: F401 - the tests import it from here
from course_lib.weights.audit import kernel_tensors


def capture_decode(engine):
    """Make ``engine``'s decode steps read the storage its tensors have now; returns it."""
    runner, model = engine.model_runner, engine.model
    remembered = {name: t.detach() for name, t in kernel_tensors(model).items()}
    head = remembered.get("lm_head.weight", remembered["model.embed_tokens.weight"])  # tied: the embedding
    eager = runner.forward_logits

    @torch.inference_mode()
    def forward_logits(seqs, is_prefill):
        if is_prefill:
            return eager(seqs, True)
        input_ids, positions, meta = runner.prepare_decode(seqs)
        hidden = functional_call(model, remembered, (input_ids, positions, meta))
        return functional_call(model.lm_head, {"weight": head}, (hidden,))[: len(seqs)]

    runner.forward_logits = forward_logits
    return engine
