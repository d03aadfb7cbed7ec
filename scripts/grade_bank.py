"""Grade a bank of wrong answers: does the judge catch each one?

    python scripts/grade_bank.py ANSWERS_DIR [--jobs 2] [--json] [--out DIR]
    python scripts/grade_bank.py DIR/bank.json --out DIR    # rewrite summary.md only

ANSWERS_DIR holds ``<chapter>/<region_name>.<label>.py`` files, each the replacement body
of one exercise region (written at the stub's indentation; an optional first line
``# why: ...`` says what the mistake is). For each answer: the instructor ``course_lib/``
is copied to a temporary folder, the region's body is replaced (markers kept, the edition
file told the region was replaced so no fast path stands in for it), and
``practice/judge.py test chNN --root TMP --exercise chNN.name --json`` grades it against
the public and hidden tests.

Verdicts: ``caught`` (a case failed or points were lost), ``not caught`` (full points),
``gpu-only`` (nothing failed but some case was not graded here, so undetermined),
``syntax`` (the answer does not compile: it does not count; fix it), ``error`` (the judge
gave no result). The catch rate is caught / (caught + not caught + gpu-only).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

VERDICTS = ("caught", "not caught", "gpu-only", "syntax", "error")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from practice.judging import regions  # noqa: E402


def read_answer(path: Path) -> tuple[str, str, str]:
    """(exercise id, why line, body at column 0) of one answer file."""
    chapter, name = path.parent.name, path.name.split(".", 1)[0]
    text = path.read_text(encoding="utf-8")
    why = next((ln.split("why:", 1)[1].strip() for ln in text.splitlines()
                if ln.strip().startswith("# why:")), "")
    return f"{chapter}.{name}", why, textwrap.dedent(text)


def grade(path: Path) -> dict:
    exercise, why, body = read_answer(path)
    row = {"answer": f"{path.parent.name}/{path.name}", "exercise": exercise, "why": why}
    try:
        compile("def _f():\n" + textwrap.indent(body, "    "), str(path), "exec")
    except SyntaxError as e:
        return {**row, "verdict": "syntax", "detail": str(e), "seconds": 0.0}
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="bank-") as tmp:
        shutil.copytree(ROOT / "course_lib", Path(tmp) / "course_lib",
                        ignore=shutil.ignore_patterns("__pycache__"))
        hit = [r for r in regions.find(Path(tmp)) if r.id == exercise]
        if not hit:
            return {**row, "verdict": "error", "detail": "no such region", "seconds": 0.0}
        src = hit[0].path
        src.write_text(regions.replace_bodies(src.read_text(encoding="utf-8"), {exercise: body}, src),
                       encoding="utf-8")
        regions.mark_edition(Path(tmp), replaced=[exercise])
        proc = subprocess.run([sys.executable, "practice/judge.py", "test", exercise.split(".")[0],
                               "--root", tmp, "--exercise", exercise, "--json"],
                              cwd=ROOT, capture_output=True, text=True)
    seconds = time.time() - start
    try:
        result = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {**row, "verdict": "error", "detail": (proc.stderr or proc.stdout)[-500:], "seconds": seconds}
    ex = next((e for e in result.get("exercises", []) if e["exercise"] == exercise), {})
    failed = [c["case"] for c in result.get("cases", []) if c["outcome"] not in ("pass", "not graded", "not_graded")
              and c.get("exercise") == exercise]
    not_graded = ex.get("not_graded", result.get("not_graded", 0))
    full = ex.get("earned", result.get("points")) == ex.get("points", result.get("max_points"))
    if failed or ex.get("failed") or not full and not not_graded:
        verdict = "caught"
    elif not_graded:
        verdict = "gpu-only"
    else:
        verdict = "not caught"
    return {**row, "verdict": verdict, "failed_cases": failed, "not_graded": not_graded,
            "points": f'{ex.get("earned")}/{ex.get("points")}', "seconds": round(seconds, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("answers", type=Path)
    p.add_argument("--jobs", type=int, default=1, choices=(1, 2))
    p.add_argument("--json", action="store_true", help="print the JSON summary instead of the table")
    p.add_argument("--out", type=Path, help="also write bank.json and summary.md here")
    args = p.parse_args()
    if args.answers.suffix == ".json":
        (args.out or args.answers.parent).joinpath("summary.md").write_text(
            markdown(json.loads(args.answers.read_text(encoding="utf-8"))), encoding="utf-8")
        return
    files = sorted(args.answers.glob("ch*/*.py"))
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(grade, files))
    counted = [r for r in rows if r["verdict"] in ("caught", "not caught", "gpu-only")]
    caught = sum(r["verdict"] == "caught" for r in counted)
    summary = {"answers": len(rows), "counted": len(counted), "caught": caught,
               "catch_rate": round(caught / len(counted), 3) if counted else None,
               "verdicts": {v: sum(r["verdict"] == v for r in rows) for v in VERDICTS},
               "seconds_per_answer": round(sum(r["seconds"] for r in rows) / max(len(rows), 1), 2),
               "rows": rows}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bank.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
        (args.out / "summary.md").write_text(markdown(summary), encoding="utf-8")
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        for r in rows:
            print(f'{r["verdict"]:<11} {r.get("points", ""):>5} {r["seconds"]:>6}s  {r["answer"]}')
        print(f'catch rate: {caught}/{len(counted)} = {summary["catch_rate"]}')


def markdown(summary: dict) -> str:
    """Per region: answers, caught, and the why of each one not caught."""
    by_region: dict[str, list[dict]] = {}
    for r in summary["rows"]:
        by_region.setdefault(r["exercise"], []).append(r)
    out = ["# Wrong-answer bank", "",
           f'{summary["caught"]} of {summary["counted"]} counted answers caught '
           f'({summary["catch_rate"]}); {summary["answers"]} answers in all; '
           f'{summary["seconds_per_answer"]} s per answer. Verdicts: '
           + ", ".join(f'{v} {sum(r["verdict"] == v for r in summary["rows"])}' for v in VERDICTS) + ".", "",
           "| chapter | answers | counted | caught | rate |", "|---|---|---|---|---|"]
    for ch in sorted({r["exercise"].split(".")[0] for r in summary["rows"]}):
        rows = [r for r in summary["rows"] if r["exercise"].startswith(ch + ".")]
        n = sum(r["verdict"] in ("caught", "not caught", "gpu-only") for r in rows)
        c = sum(r["verdict"] == "caught" for r in rows)
        out.append(f"| {ch} | {len(rows)} | {n} | {c} | {c / n if n else 0:.2f} |")
    out += ["", "| region | answers | caught | not caught / other |", "|---|---|---|---|"]
    for ex, rows in sorted(by_region.items()):
        other = "<br>".join(f'{r["verdict"]}: `{r["answer"]}`: {r["why"]}' for r in rows if r["verdict"] != "caught")
        out.append(f'| {ex} | {len(rows)} | {sum(r["verdict"] == "caught" for r in rows)} | {other} |')
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
