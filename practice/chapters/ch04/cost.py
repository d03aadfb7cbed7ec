"""Chapter 04's cost proxies on any machine: the commit step (``CopyPlan.apply``) writing a
whole update of a small model, counted by ``course_lib.cost``.

``python practice/judge.py cost ch04`` runs ``scenario()`` on your ``course_lib`` and prints
its counts beside the instructor edition's (``REFERENCE``, counted by the maintainers on the
same scenario; a test keeps it current). The GPU speed part stays the graded speed; these
counts say where your design spends before a GPU is at hand: every copy is a kernel
launch on a GPU, every allocation is memory the step did not need, every host wait stalls
the whole update.
"""
PART = "ch04.copy_in_place"
REFERENCE = {"ops": 25, "copies": 25, "allocations": 0, "allocated_bytes": 0, "host_waits": 0}


def scenario():
    """A zero-argument function that makes the commit step write every tensor of a whole
    update once (8 decoder layers, MLP weights of 1 MB, new values in every tensor)."""
    import tempfile

    import torch

    from course_lib import Engine
    from course_lib.weights.checkpoint import make_random, preset
    from course_lib.weights.commit.copy_plan import CopyPlan

    config = preset("tiny", num_hidden_layers=8, hidden_size=256, intermediate_size=1024)  # MLP weights of 1 MB
    with tempfile.TemporaryDirectory() as d:
        engine = Engine(make_random(f"{d}/m", config, seed=1), max_model_len=64)
    plan = CopyPlan.for_model(engine.model)
    gen = torch.Generator().manual_seed(4)
    pairs = [(name, torch.randn(view.shape, generator=gen, dtype=view.dtype))
             for name, view in plan.views.items() if view is not None]
    return lambda: plan.apply(pairs)
