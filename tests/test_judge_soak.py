"""judge.py soak: the reference's hidden cases at many seeds, one process looping over them.

Chapter 00 is the small one (a few seconds a soak). The reference passes every case at
every seed; a wrong answer that only some draws expose is caught at some seeds and not at
others (so the seed really changes between runs of one process), each failure with its
seed and a replay command; a module-level ``SEED = hidden_seed()`` is drawn anew per seed.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "practice"))

from judging import regions  # noqa: E402
from judging.checks import variant_root  # noqa: E402
from judging.soak import soak  # noqa: E402

pytestmark = pytest.mark.skipif(not (REPO / "practice" / "hidden" / "chapters" / "ch00").is_dir(),
                                reason="the hidden tests are in the instructor edition only")


def test_the_reference_passes_ch00_at_every_seed_from_the_command_line():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("COURSE_HIDDEN_DIR", None)
    proc = subprocess.run([sys.executable, "practice/judge.py", "soak", "ch00", "--seeds", "2", "--start", "5",
                           "--scenarios", "5"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("soak ch00 (chapter): seeds 5..6 (2 seeds), 1 process(es), ")
    rows = [line for line in lines if line.startswith("test_hidden.py::")]
    assert len(rows) >= 10 and "test_hidden.py::test_estimate_update_random_sizes" in proc.stdout
    for row in rows:  # every case, under its exercise, at both seeds
        assert row.split()[1] in ("ch00.cold_start_phases", "ch00.estimate_update"), row
        assert row.endswith("passed in 2 of 2 seeds"), row
    # ch00's two differential (hypothesis) cases run once, apart from the seeds
    hypothesis = [line for line in lines if line.startswith("test_differential.py::")]
    assert len(hypothesis) == 2 and "failures:" not in proc.stdout, proc.stdout[-2000:]
    assert "hypothesis cases: run once with COURSE_SCENARIOS=5" in proc.stdout, proc.stdout[-2000:]
    assert lines[-1] == "soak ch00: pass: every case ran and passed at every one of the 2 seeds"


def test_a_wrong_answer_that_only_some_draws_expose_is_caught_at_some_seeds(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("COURSE_HIDDEN_DIR", raising=False)
    region = next(r for r in regions.find(REPO) if r.id == "ch00.estimate_update")
    right = 'seconds["total"] = (sum(busy) + (chunks - 1) * max(busy)) / chunks\n'
    body = textwrap.dedent(region.body)
    assert right in body
    # Wrong only for 64 chunks on 8 GPUs (phases run one after another): 1 draw in 320.
    wrong = body.replace(right, 'seconds["total"] = (sum(busy) + (chunks - 1) * max(busy)) / chunks\n'
                                'if chunks == 64 and num_gpus == 8:\n    seconds["total"] = sum(busy)\n')
    root = variant_root(REPO, "ch00.estimate_update", wrong)
    try:
        record = soak("ch00", range(0, 6), root=root, scenarios=5)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert record["status"] == "fail"
    row = next(c for c in record["cases"] if c["case"] == "test_hidden.py::test_estimate_update_random_sizes")
    seeds = [f["seed"] for f in row["failures"]]
    assert 0 < len(seeds) < 6 and row["passed"] == 6 - len(seeds), row  # some seeds catch it, some do not
    first = row["failures"][0]
    assert f"seed {first['seed']}:" in first["message"]  # the case's own words name the seed it drew
    assert first["replay"] == (f"COURSE_HIDDEN_SEED={first['seed']} python practice/judge.py test ch00 "
                               "--exercise ch00.estimate_update -k test_estimate_update_random_sizes"
                               ).replace("practice/judge.py", os.path.relpath(REPO / "practice" / "judge.py"))
    phases = [c for c in record["cases"] if c["exercise"] == "ch00.cold_start_phases"]
    assert phases and all(c["status"] == "pass" for c in phases)  # the other exercise is untouched


def test_a_module_level_seed_is_drawn_anew_at_each_seed(tmp_path, monkeypatch):
    """A hidden test module reads its seed at import: each seed of one process re-imports it."""
    hidden = tmp_path / "chapters" / "ch00"
    hidden.mkdir(parents=True)
    (hidden / "test_hidden.py").write_text(textwrap.dedent("""
        import pytest
        from conftest import hidden_seed

        SEED = hidden_seed()
        pytestmark = pytest.mark.exercise("ch00.estimate_update")


        def test_module_seed_is_not_one():
            assert SEED != 1, f"seed {SEED}: module-level draw"


        def test_fixture_seed_is_not_two():
            assert hidden_seed() != 2, f"seed {hidden_seed()}: draw inside the case"


        @pytest.mark.cuda
        def test_needs_a_gpu():
            pass
    """), encoding="utf-8")
    monkeypatch.setenv("COURSE_HIDDEN_DIR", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the cuda case must not run, even on a GPU machine
    record = soak("ch00", range(0, 4), jobs=2)
    rows = {c["case"].split("::")[-1]: c for c in record["cases"]}
    assert set(rows) == {"test_module_seed_is_not_one", "test_fixture_seed_is_not_two", "test_needs_a_gpu"}
    assert [f["seed"] for f in rows["test_module_seed_is_not_one"]["failures"]] == [1]
    assert [f["seed"] for f in rows["test_fixture_seed_is_not_two"]["failures"]] == [2]
    assert rows["test_module_seed_is_not_one"]["passed"] == 3
    gpu = rows["test_needs_a_gpu"]
    assert (gpu["status"], gpu["passed"], gpu["not_run"]) == ("not run here", 0, 4)  # never counted as passed
    assert record["status"] == "fail" and record["processes"] == 2


def test_a_seed_past_its_time_limit_fails_and_the_next_seeds_still_run(tmp_path, monkeypatch):
    """The seed that hangs ends its process; its case fails with the limit named, and a new
    process goes on from the next seed (never reported as passed, never silently dropped)."""
    hidden = tmp_path / "chapters" / "ch00"
    hidden.mkdir(parents=True)
    (hidden / "test_hidden.py").write_text(textwrap.dedent("""
        import time

        import pytest
        from conftest import hidden_seed

        pytestmark = pytest.mark.exercise("ch00.estimate_update")


        def test_hangs_at_seed_one():
            if hidden_seed() == 1:
                time.sleep(120)
    """), encoding="utf-8")
    monkeypatch.setenv("COURSE_HIDDEN_DIR", str(tmp_path))
    record = soak("ch00", range(0, 3), timeout=10)
    (row,) = [c for c in record["cases"] if c["case"].endswith("test_hangs_at_seed_one")]
    assert (row["passed"], row["failed"]) == (2, 1), row
    (failure,) = row["failures"]
    assert failure["seed"] == 1 and "within the time limit of 10 s" in failure["message"], failure
    assert record["status"] == "fail"
