"""Words for results: one line per case, then a score line that never counts an ungraded case."""
from __future__ import annotations

from judging.problems import HIDDEN_ABSENT
from judging.run import Case, RunResult


# A message's further lines, under the case they belong to.
INDENT = "\n      "


def case_line(case: Case) -> str:
    """``  case ... verdict``: pass, ``FAIL: why``, ``WAITS: why`` (in the notebook's words,
    chapter_run.wait_message) or ``not graded: needs CUDA``."""
    if case.outcome == "pass":
        verdict = "pass"
    elif case.outcome == "not graded":
        verdict = f"not graded: {case.message}"
    elif case.outcome == "waits":
        verdict = f"WAITS: {case.message}"
    else:
        verdict = f"FAIL: {case.message}"
    return f"  {case.case} ... {INDENT.join(verdict.splitlines())}"


def score_line(result: RunResult) -> str:
    passed, graded = result.count("pass"), result.graded
    skipped, waits = result.count("not graded"), result.count("waits")
    line = f"score: {passed}/{graded} graded cases passed"
    if skipped:
        line += f"; {skipped} not graded (needs CUDA; not counted as passed)"
    if waits:
        line += f"; {waits} wait for a later part not written yet (not counted as passed)"
    if graded == 0:
        line += "; nothing was graded, so this is not a pass"
    return line


def print_run(result: RunResult, hidden_dir) -> None:
    print(f"{result.problem}: grading {result.file}")
    print(f"hidden tests: from {hidden_dir}" if result.hidden else HIDDEN_ABSENT)
    for case in result.cases:
        print(case_line(case))
    print(score_line(result))
    print(status_line(result.status, result))


def summary(result: RunResult) -> str:
    """A short phrase for tables: '12/12 passed', '3 failed of 12', '+1 not graded', '+2 wait'."""
    failed, graded = result.count("fail"), result.graded
    text = f"{result.count('pass')}/{graded} passed" if not failed else f"{failed} failed of {graded}"
    if result.count("not graded"):
        text += f", {result.count('not graded')} not graded"
    if result.count("waits"):
        text += f", {result.count('waits')} wait"
    return text


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    lines += [fmt.format(*map(str, r)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


NOT_GRADED_HERE = "not graded here"


def check_verdict(should_pass: bool, result: RunResult) -> str:
    """'ok'; or 'not graded here: ...' when only cases this machine cannot run (GPU) could
    decide it (a case that did not run is never a pass, nor a failure of the check); or in
    words why a reference (should_pass) or a starter / wrong answer breaks the rules."""
    if not result.hidden:
        return "WRONG: no hidden tests (practice/hidden/<slug>/ or $COURSE_HIDDEN_DIR/<slug>/)"
    skipped = result.count("not graded")
    if should_pass:
        bad = next((c for c in result.cases if c.outcome in ("fail", "waits")), None)
        if bad is not None:  # a reference has no unwritten part to wait for
            return f"WRONG: the reference fails {bad.case}: {bad.message}"
        if result.graded:
            return "ok"
        return f"{NOT_GRADED_HERE}: all {skipped} cases need a GPU" if skipped else "WRONG: nothing was graded"
    if result.count("fail"):
        return "ok"
    if skipped:
        return f"{NOT_GRADED_HERE}: passes every case run here; {skipped} case(s) that need a GPU did not run"
    return "WRONG: passes every graded case"


def print_chapter(chapter, result: RunResult, exercises: list[dict], hidden_dir) -> None:
    """A chapter run: its cases under each exercise, a line per exercise (a failing one
    names the notebook section to read), then the score and status."""
    print(f"{chapter.id} · {chapter.title}: grading the course_lib in {result.file}")
    print(f"hidden tests: from {hidden_dir}" if result.hidden else HIDDEN_ABSENT)
    for ex in exercises:
        print(f"{ex['exercise']} · {ex['title']} ({ex['points']:g} points)")
        for case in result.cases:
            if case.exercise in (ex["exercise"], ""):
                print(case_line(case))
        print(exercise_line(chapter, ex))
    print(score_line(result))
    earned, top = sum(e["earned"] for e in exercises), sum(e["points"] for e in exercises)
    print(f"points: {earned:g}/{top:g}")
    for name in getattr(chapter, "warmups", ()):
        print(f"not graded by the judge: notebook warm-up {name} ({chapter.notebook}: its own cell checks it)")
    print(status_line(chapter_status(result, exercises), result))


def exercise_line(chapter, ex: dict) -> str:
    """``  => verdict: points`` with why; a failing exercise names the section that explains it."""
    verdict = {"pass": "pass", "fail": "FAIL", "waits": "WAITS", "incomplete": "INCOMPLETE"}[ex["status"]]
    line = f"  => {verdict}: {ex['earned']:g}/{ex['points']:g} points"
    if ex["status"] == "fail":  # the case lines above say what failed; this says where to read
        # A test-writing part that earned a share says how many variants its tests caught.
        why = "" if ex["failed"] and not ex["earned"] else f" ({ex['message']})"
        return line + why + f"; read {chapter.notebook}, section “{ex['section']}”"
    return line + (f" ({ex['message']})" if ex["message"] else "")


def chapter_status(result: RunResult, exercises: list[dict]) -> str:
    """pass, fail or incomplete (nothing failed; some cases need a GPU or wait for a later part)."""
    statuses = {e["status"] for e in exercises} | {result.status}
    return "fail" if "fail" in statuses else "incomplete" if statuses & {"incomplete", "waits"} else "pass"


def status_line(status: str, result: RunResult) -> str:
    """The last line of a run: 'complete' only when every case ran and passed."""
    gpu, waits = result.count("not graded"), result.count("waits")
    if status == "pass":
        return "status: complete (every case ran and passed)"
    reasons = ([f"{gpu} case(s) need a GPU and were not graded"] if gpu else []) + (
        [f"{waits} case(s) wait for a later part not written yet"] if waits else [])
    if status == "incomplete":
        until = " and ".join((["they run on a GPU"] if gpu else []) + (["that part is written"] if waits else []))
        return (f"status: incomplete: {'; '.join(reasons)}; nothing failed, but this is not a pass until "
                f"{until} (exit code 3)")
    return "status: FAIL" + (f" (and {'; '.join(reasons)})" if reasons else "")
