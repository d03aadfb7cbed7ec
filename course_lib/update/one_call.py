"""One call per update: pause, update and continue between two steps of the engine's loop.

SGLang's flow is four kinds of request (pause, flush until done, the update's messages,
continue), each an HTTP round trip while clients wait; the engine's own work is often the
smallest part of the stall. With ``UpdateOptions.pause_mode`` and ``resume`` one call does
it all on the engine's thread: the pause in that mode, the update (its own flush, the same
validation, refusals and rollback as ever), then the continue. An update sent as several
messages (a trainer's buckets) puts the pause on its first message and the continue on its
last. A call that fails continues generation only when no weight changed during this pause
(the old weights serve, whole); once one did, the engine stays paused, as a trainer's
client leaves it after a failed later bucket (a mix of two versions must not serve).
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable

from course_lib.update.records import UpdateOptions


def _ms(since: float) -> float:
    return 1e3 * (time.perf_counter() - since)


def asks_for_one_call(options: UpdateOptions) -> bool:
    return options.pause_mode is not None or options.resume is not None


def with_pause(pause, resume: Callable[[], object], run: Callable[[], dict], options: UpdateOptions,
               healthy: Callable[[], bool]) -> dict:
    """``run()`` (the update) with ``pause.pause_generation(options.pause_mode)`` before it
    and ``resume()`` after it, as the options ask (module docstring). The reply is the
    update's, with the ``pause`` and ``continue`` phases in ``timings_ms`` and the pause's
    ``num_aborted_requests``."""
    resume_after = options.resume if options.resume is not None else options.pause_mode is not None
    before = {}
    aborted = 0
    if options.pause_mode is not None:
        t0 = time.perf_counter()
        aborted = pause.pause_generation(options.pause_mode)["num_aborted_requests"]
        before["pause"] = _ms(t0)
    landed = pause.stats[-1].updates if pause.paused else 0  # updates already made in this pause
    try:
        result = run()
    except BaseException:
        unchanged = not pause.paused or pause.stats[-1].updates == landed == 0
        if resume_after and unchanged and healthy():
            with contextlib.suppress(Exception):  # the update's error is the one to report
                resume()
        raise
    after = {}
    if resume_after:
        t0 = time.perf_counter()
        resume()
        after["continue"] = _ms(t0)
    result["timings_ms"] = {**before, **result["timings_ms"], **after}
    result["elapsed_ms"] = sum(result["timings_ms"].values())
    result["num_aborted_requests"] = aborted
    return result
