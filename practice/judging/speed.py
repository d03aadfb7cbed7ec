"""The speed tier: a part's speed on the GPU beside the reference's, as a score of its own.

Chapters 03, 04 and 05 each name one "make it fast" part in ``chapter.json``
(``"speed": {"exercise": ..., "scenario": "speed_scenarios:<name>"}``). Its correctness is
graded as every part's is (``judge.py test``); its speed is measured here, on a GPU only:
the scenario (``hidden/chapters/shared/speed_scenarios.py``) runs in a child process on
the learner's ``course_lib`` and in another on the reference's, alternately, ``repeats``
times, in the same run; each side's best median counts. The figure is reported as ratios:
to the reference's (``vs_reference``) and to a device copy of the same bytes measured
beside it (``vs_copy``). A part whose output was wrong, or that reports more than the
device copy can move, gets no speed score ("refused"). Without a GPU nothing is measured:
"not measured here". No timing ever decides a pass or a fail.
"""
from __future__ import annotations

import sys
from pathlib import Path

from judging.chapter_run import reference_root
from judging.chapters import Chapter
from judging.problems import PRACTICE

SHARED = PRACTICE / "hidden" / "chapters" / "shared"
IMPOSSIBLE = 1.05  # above the same bytes' device copy by more than timing noise


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def measure(chapter: Chapter, root: Path, repeats: int = 3) -> dict | None:
    """The speed record of ``chapter``'s speed part in ``root``'s course_lib (None: the
    chapter has none)."""
    spec = chapter.speed
    if not spec:
        return None
    record = {"chapter": chapter.id, "exercise": spec["exercise"], "scenario": spec["scenario"]}
    if not cuda_available():
        return dict(record, status="not measured here", why="the speed tier is measured on a GPU only")
    ref_root = reference_root()
    if ref_root is None or not SHARED.is_dir():
        return dict(record, status="not measured here", why="no reference edition beside this judge")
    if str(SHARED) not in sys.path:
        sys.path.insert(0, str(SHARED))
    import twin

    mine, theirs = twin.Reference(str(root), require_reference=False), twin.Reference(ref_root)
    try:
        learner, reference = [], []
        for _ in range(repeats):  # alternately, so both meet the same machine
            try:
                learner.append(mine.run(spec["scenario"]))
            except twin.ReferenceFailed as exc:
                return dict(record, status="refused", why=f"the part failed while timed: {str(exc)[:300]}")
            try:
                reference.append(theirs.run(spec["scenario"]))
            except twin.ReferenceFailed as exc:  # the grader's fault: no figure, and no blame
                return dict(record, status="not measured here", why=f"the reference failed: {str(exc)[:300]}")
    finally:
        mine.close()
        theirs.close()
    return dict(record, **score(learner, reference))


def score(learner: list[dict], reference: list[dict]) -> dict:
    """Ratios from the two sides' runs (best of each), or why there is no score."""
    wrong = [r for r in learner if not r["correct"]]
    best = max(learner, key=lambda r: r["gbps"])
    ref = max(reference, key=lambda r: r["gbps"])
    figures = dict(learner_gbps=round(best["gbps"], 2), reference_gbps=round(ref["gbps"], 2),
                   copy_gbps=round(best["copy_gbps"], 2), bytes=best["bytes"])
    if wrong:
        return dict(figures, status="refused", why=f"wrong output while timed: {wrong[0]['why'] or 'see the scenario'}")
    if best["gbps"] > IMPOSSIBLE * best["copy_gbps"]:
        return dict(figures, status="refused", why=f"{best['gbps']:.1f} GB/s is more than the device copy of the "
                                                   f"same bytes ({best['copy_gbps']:.1f} GB/s): impossible")
    return dict(figures, status="measured", vs_reference=round(best["gbps"] / ref["gbps"], 3),
                vs_copy=round(best["gbps"] / best["copy_gbps"], 3))


def line(rec: dict) -> str:
    head = f"{rec['exercise']} speed ({rec['scenario'].split(':')[1]}): "
    if rec["status"] != "measured":
        return head + f"{rec['status']}: {rec.get('why', '')}"
    return head + (f"{rec['learner_gbps']:.1f} GB/s, {rec['vs_reference']:.2f}x the reference's "
                   f"({rec['reference_gbps']:.1f} GB/s), {rec['vs_copy']:.0%} of a device copy "
                   f"({rec['copy_gbps']:.1f} GB/s)")


def board(records: list[dict]) -> str:
    """A class leaderboard per speed part: learners by their ratio to the reference."""
    out = []
    for exercise in sorted({r["exercise"] for r in records}):
        rows = sorted((r for r in records if r["exercise"] == exercise),
                      key=lambda r: (r["status"] != "measured", -r.get("vs_reference", 0.0)))
        out.append(f"{exercise}")
        for rank, r in enumerate(rows, 1):
            figure = (f"{r['vs_reference']:.2f}x reference, {r['vs_copy']:.0%} of copy, {r['learner_gbps']:.1f} GB/s"
                      if r["status"] == "measured" else f"{r['status']}: {r.get('why', '')[:80]}")
            out.append(f"  {rank:>3}. {r.get('learner', '?'):<20} {figure}")
    return "\n".join(out) if out else "no speed records"
