"""A cold start of the engine, phase by phase, in this fresh process (run by file path).

    python course_lib/bench/cold_start.py CHECKPOINT --device cuda

Run by path rather than ``-m`` so that nothing (not even torch) is imported before the
first timestamp. Prints one JSON line, ``{"marks": [[phase, time.time()], ...]}``: when
each phase ended. The parent knows when it spawned this process and turns the marks into
seconds per phase with ``phases_from_marks`` (hot_vs_cold.cold_restart does).
"""
import time

T_FIRST_LINE = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402


def phases_from_marks(spawned_at: float, marks) -> dict[str, float]:
    """Seconds per phase of a cold start, from the timestamps its process took.

    ``spawned_at``: the ``time.time()`` at which the parent spawned the process; the first
    phase starts there. ``marks``: ``(phase name, time.time() when that phase ended)``
    pairs in the order they were taken (two-element lists, as JSON gives them, work too).

    Returns a new dict ``{phase: seconds, ..., "total": seconds}``: each phase lasts from
    the previous mark (``spawned_at`` for the first) to its own mark; the phases come in
    the order of the marks, then ``"total"``, from ``spawned_at`` to the last mark (so the
    phases add up to the total). No marks: ``{"total": 0.0}``. A phase may last 0 s.

    Raises ``ValueError`` naming the mark when a phase name repeats or is ``"total"``, when
    ``spawned_at`` or a timestamp is not a finite number, or when a mark is earlier than
    the one before it (or than ``spawned_at``): a negative phase is a bug, never a result.
    ``marks`` is left unchanged.
    """
    # BEGIN EXERCISE ch00.cold_start_phases
    if not math.isfinite(spawned_at):
        raise ValueError(f"spawned_at must be a finite time, got {spawned_at!r}")
    phases: dict[str, float] = {}
    previous = spawned_at
    for name, at in marks:
        if name == "total" or name in phases:
            raise ValueError(f"phase name {name!r} is repeated or reserved ('total' is the sum)")
        if not math.isfinite(at):
            raise ValueError(f"phase {name!r}: its mark must be a finite time, got {at!r}")
        if at < previous:
            raise ValueError(f"phase {name!r} ends at {at!r}, before the mark before it ({previous!r})")
        phases[name] = at - previous
        previous = at
    phases["total"] = previous - spawned_at
    return phases
    # END EXERCISE


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=16)
    args = p.parse_args()
    marks = [("process_start", T_FIRST_LINE)]
    import torch
    marks.append(("import_torch", time.time()))
    from course_lib import Engine
    marks.append(("import_course_lib", time.time()))
    if args.device.startswith("cuda"):
        torch.cuda.init()
        torch.empty(1, device=args.device).add_(1)
        torch.cuda.synchronize()
    marks.append(("device_init", time.time()))
    t = time.time()
    engine = Engine(args.checkpoint, device=args.device, max_model_len=args.max_model_len,
                    max_num_seqs=args.max_num_seqs)
    # The engine times its own weight load; the rest of its start-up (config, KV pool,
    # CUDA-graph capture, address audit) is counted in the next phase.
    marks.append(("load_weights", t + engine.timings["load_weights_s"]))
    marks.append(("kv_pool_and_graph_capture", time.time()))
    engine.generate("first token", {"max_new_tokens": 1, "temperature": 0})
    marks.append(("first_token", time.time()))
    print(json.dumps({"marks": marks}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
