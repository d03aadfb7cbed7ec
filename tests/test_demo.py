"""``python -m course_lib demo``: a real process prints the spans, the update's timings and
the hot == cold verdict; and in every pause mode the version spans it shows are honest:
the tokens labelled v1 are what v1 computes, the tokens labelled v2 what v2 computes."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib import Engine
from course_lib import demo

ROOT = Path(__file__).resolve().parents[1]
SEED = 5


def run_cli(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "course_lib", "demo", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_shows_spans_timings_and_hot_equals_cold():
    proc = run_cli()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "pause_generation('retract')" in out
    n_before = demo.STEPS_BEFORE_PAUSE
    bar = " ".join(["v1"] * n_before) + " | " + " ".join(["v2"] * (demo.REQUESTS[1][1] - n_before))
    assert bar in out, "the in-flight requests' version bar (v1 tokens | v2 tokens)"
    assert f"v1:0-{n_before}, v2:{n_before}-" in out, "the spans as meta_info gives them"
    for phase in ("timings_ms:", "validate", "transfer", "copy", "audit", "flush", "bytes"):
        assert phase in out, f"the update's phase timings: {phase!r}"
    assert "re-prefilled" in out and "mixing v1 and v2" in out, "the pause's measured costs"
    assert "hot == cold" in out and "hot != cold" not in out
    assert "jupyter lab notebooks/" in out and "serve" in out and "judge.py" in out
    assert len(out.splitlines()) <= 40, "one screen"


@pytest.mark.parametrize("args, words", [(["--preset", "huge"], "unknown preset 'huge'"),
                                         (["--mode", "pause"], "invalid choice: 'pause'")])
def test_cli_refuses_bad_options_clearly(args, words):
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert words in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    """The same checkpoints the demo makes from SEED (make_random is deterministic)."""
    return make_ckpt("tiny", seed=SEED), make_ckpt("tiny", seed=SEED + 1)


def greedy_ids(path, n, prompt=None, input_ids=None):
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    engine = Engine(path)
    if input_ids is not None:
        return engine.generate(input_ids=[input_ids], sampling_params=params)[0]["output_ids"]
    return engine.generate([prompt], params)[0]["output_ids"]


def versions(out) -> list[str]:
    """One version per output token, rebuilt from the spans (which must tile the output)."""
    tags, at = [], 0
    for span in out["meta_info"]["weight_versions"]:
        assert span["start"] == at < span["end"], f"spans must tile the output: {out['meta_info']}"
        tags += [span["version"]] * (span["end"] - span["start"])
        at = span["end"]
    assert at == len(out["output_ids"])
    return tags


@pytest.mark.parametrize("mode", demo.MODES)
def test_spans_are_honest_in_every_mode(mode, ckpts):
    v1, v2 = ckpts
    result = demo.run(mode, "cpu", SEED)
    assert result["hot_equals_cold"] is None
    first, *in_flight, late = result["outputs"]
    n_before = demo.STEPS_BEFORE_PAUSE
    assert versions(first) == ["v1"] * demo.REQUESTS[0][1]
    assert first["output_ids"] == greedy_ids(v1, demo.REQUESTS[0][1], first["prompt"])
    assert versions(late) == ["v2"] * demo.LATE_REQUEST[1]
    assert late["output_ids"] == greedy_ids(v2, demo.LATE_REQUEST[1], late["prompt"])
    for out, (_, n) in zip(in_flight, demo.REQUESTS[1:]):
        tags, ids = versions(out), out["output_ids"]
        v1_ids = greedy_ids(v1, n, out["prompt"])
        if mode == "abort":      # ended at the pause: only what v1 made, nothing from v2
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
            assert tags == ["v1"] * n_before and ids == v1_ids[:n_before]
        elif mode == "wait":     # ran to the end on v1 before the update landed
            assert tags == ["v1"] * n and ids == v1_ids
        else:                    # v1 until the pause, v2 from the next token on
            assert tags == ["v1"] * n_before + ["v2"] * (n - n_before)
            assert ids[:n_before] == v1_ids[:n_before]
        if mode == "retract":    # re-prefilled on v2: a cold v2 engine continuing the same tokens
            prompt_ids = Engine(v1).tokenizer.encode(out["prompt"])
            assert ids[n_before:] == greedy_ids(v2, n - n_before, input_ids=prompt_ids + ids[:n_before])
    pause = result["pause"]
    assert pause["mode"] == mode
    assert pause["mixed_requests"] == (2 if mode in ("keep", "retract") else 0)
    assert pause["kv_fresh"] == (mode != "keep")


def test_version_bar():
    spans = [{"version": "v1", "start": 0, "end": 2}, {"version": "v2", "start": 2, "end": 5}]
    assert demo.version_bar(spans) == "v1 v1 | v2 v2 v2"
    assert demo.version_bar([]) == ""


def test_run_refuses_bad_options_before_doing_anything():
    with pytest.raises(ValueError, match="unknown mode 'in_place'"):
        demo.run("in_place")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        demo.run("keep", device="tpu")


def test_hot_not_equal_cold_is_reported(ckpts):
    """The verdict can fail: an engine updated to v2 compared with a cold start on v1."""
    v1, v2 = ckpts
    engine = Engine(v1)
    engine.update_weights_from_disk(v2)
    lines = []
    verdict = demo.check_hot_equals_cold(engine, v1, lines.append)
    assert verdict is not None and "hot != cold" in verdict
    assert lines[0].startswith("6. hot != cold")
