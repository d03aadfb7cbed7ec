"""How long should a hot update take? Bytes over bandwidth, phase by phase, from numbers
the engine and the hardware report (chapter 00 puts the estimate beside measurements).

Bandwidths are in GB/s with 1 GB = 1e9 bytes, as every benchmark of this course reports
them. An estimate is a floor: it leaves out validation, the address audit, cache flushes
and waiting for a step boundary, which the engine times separately.
"""
from __future__ import annotations

import math

# The phases each transport's bytes pass through on their way into the live weights.
TRANSPORTS: dict[str, tuple[str, ...]] = {
    "disk": ("read", "host_to_device", "copy"),   # file -> host memory -> device -> in place
    "ipc": ("copy",),                             # a co-located trainer's device buffers -> in place
    "dist": ("network", "copy"),                  # a broadcast into a receive buffer -> in place
}


def estimate_update(nbytes: float, bandwidths: dict[str, float], phases=TRANSPORTS["disk"], *,
                    chunks: int = 1, num_gpus: int = 1) -> dict[str, float]:
    """Seconds a hot update of ``nbytes`` of weights spends in each phase, and in all.

    ``nbytes``: the whole model's weight bytes (a non-negative number). ``bandwidths``:
    GB/s per phase name (1 GB = 1e9 bytes); keys not in ``phases`` are ignored.
    ``phases``: the phase names the bytes pass through, in order (``TRANSPORTS[...]``).
    ``num_gpus``: the model is split evenly over this many GPUs; each receives its own
    share through every phase, all GPUs at the same time. ``chunks``: the bytes move in
    this many equal chunks, pipelined: while one phase works on a chunk, the next phase
    works on the chunk before it (``chunks=1``: one phase after the other).

    Returns a new dict: for each phase in order, the seconds it is busy moving one GPU's
    share (``share / (GB/s * 1e9)``), then ``"total"``: the first chunk passes every phase,
    then each further chunk leaves at the pace of the slowest phase, so
    ``total = (sum of phases + (chunks - 1) * slowest phase) / chunks``
    (with ``chunks=1`` just the sum). ``nbytes=0`` gives zeros.

    Raises ``ValueError`` naming what was wrong when ``nbytes`` is negative or not finite,
    ``phases`` is empty, repeats a name or names ``"total"``, a phase has no bandwidth or
    one that is not a positive finite number, or ``chunks`` or ``num_gpus`` is not a whole
    number >= 1. ``bandwidths`` is left unchanged.
    """
    # BEGIN EXERCISE ch00.estimate_update
    if not math.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative number of bytes, got {nbytes!r}")
    for name, value in (("chunks", chunks), ("num_gpus", num_gpus)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    phases = tuple(phases)
    if not phases or len(set(phases)) != len(phases) or "total" in phases:
        raise ValueError(f"phases must be distinct names other than 'total', got {phases!r}")
    share = nbytes / num_gpus
    seconds: dict[str, float] = {}
    for phase in phases:
        gbps = bandwidths.get(phase)
        if gbps is None or not math.isfinite(gbps) or gbps <= 0:
            raise ValueError(f"phase {phase!r} needs a positive bandwidth in GB/s, got {gbps!r}")
        seconds[phase] = share / (gbps * 1e9)
    busy = list(seconds.values())
    seconds["total"] = (sum(busy) + (chunks - 1) * max(busy)) / chunks
    return seconds
    # END EXERCISE


def estimate_restart(nbytes: float, bandwidths: dict[str, float], startup_s: float, *,
                     num_gpus: int = 1) -> float:
    """Seconds a restart takes: the fixed start-up a hot update skips (process, imports,
    device, KV pool, graphs, first token: ``startup_s``, measured), plus reading the
    weights and moving them to the device (no in-place copy: they load where they live)."""
    load = estimate_update(nbytes, bandwidths, ("read", "host_to_device"), num_gpus=num_gpus)
    return startup_s + load["total"]
