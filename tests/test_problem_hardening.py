"""Each kind of wrong or gaming answer the practice problems' hidden tests must catch, with
the wrong answer that shows it and the hidden case that catches it.

Every row runs the judge on that one case (``-k``): the wrong answer must fail it and the
reference must pass it. Rows whose case needs a GPU are checked on a GPU only. The whole
table is slow (each row starts engines in a fresh process), so it runs with ``-m slow``.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (problem, wrong answer, hidden case that catches it, needs a GPU)
KINDS = {
    "empty: an empty bucket": ("fast-bucket-update", "copies_with_one_foreach_call",
                               "test_an_empty_bucket_changes_nothing", False),
    "empty: an empty list of tensors": ("bucket-handoff", "buffers_from_the_first_tensor",
                                        "test_nothing_to_send_posts_nothing", False),
    "empty: no requests in flight": ("inplace-requant", "no_requests_in_flight",
                                     "test_pause_costs_with_no_requests_in_flight", False),
    "empty: an empty batch of prompts": ("partial-rollout-sync", "empty_batch_skips_the_sync",
                                         "test_an_empty_batch_still_syncs", False),
    "empty: empty answers compared": ("canary-rollback", "empty_answer_agrees",
                                      "test_empty_answers_in_the_comparison", False),
    "right element count, wrong shape (int8 layer)": ("inplace-requant", "reshapes_same_element_count",
                                                      "test_hot_update_refuses_the_right_element_count", False),
    "right element count, wrong shape (bucket)": ("fast-bucket-update", "checks_numel_not_shape",
                                                  "test_the_right_element_count_in_the_wrong_shape", False),
    "a temporary float copy into bf16": ("fast-bucket-update", "temporary_float_copy",
                                         "test_a_bfloat16_engine_fed_bfloat16_buckets", False),
    "float32 fed where the engine feeds bf16 (requant)": ("inplace-requant", "half_precision_arithmetic",
                                                          "test_quantize_half_precision_weights", False),
    "float32 fed where the engine feeds bf16 (bytes)": ("fast-bucket-update", "counts_bytes_of_the_model_dtype",
                                                        "test_random_models_hot_equals_cold", False),
    "a NaN checkpoint escapes, engine paused": ("canary-rollback", "prechecks_the_shape",
                                                "test_a_checkpoint_with_a_nan_is_rejected", False),
    "one length for every request (canary)": ("canary-rollback", "one_length_for_all",
                                              "test_answers_of_different_lengths", False),
    "one length for every request (rollouts)": ("partial-rollout-sync", "steps_for_the_first_length",
                                                "test_every_request_runs_to_its_own_length", False),
    "a request finished before the sync": ("partial-rollout-sync", "drops_what_finished_before_the_sync",
                                           "test_a_request_that_finishes_before_the_sync", False),
    "gaming: skips buffers already seen": ("fast-bucket-update", "skips_buffers_already_seen",
                                           "test_a_reused_buffer_with_new_bytes_is_applied_again", False),
    "gaming: skips buffers already seen (timed)": ("fast-bucket-update", "skips_buffers_already_seen",
                                                   "test_speed_against_the_reference_on_a_gpu", True),
    "gaming: rewrites the statistics": ("bucket-handoff", "rewrites_the_statistics",
                                        "test_any_number_of_buffers", False),
}


def judge(problem: str, file: Path, case: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    out = subprocess.run([sys.executable, str(ROOT / "practice" / "judge.py"), "test", problem, "--file", str(file),
                          "-k", case, "--json"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    return json.loads(out.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.cuda) if v[3] else k for k, v in KINDS.items()])
def test_each_kind_is_caught_by_its_hidden_case(kind):
    problem, wrong, case, _ = KINDS[kind]
    folder = ROOT / "practice" / "problems" / problem
    caught = judge(problem, folder / "wrong" / f"{wrong}.py", case)
    assert caught["failed"] > 0, f"{kind}: wrong/{wrong}.py fails {case}, but: {caught['cases']}"
    assert any(case in c["case"] and c["outcome"] == "fail" for c in caught["cases"])
    reference = judge(problem, folder / "solution.py", case)
    assert reference["failed"] == 0 and reference["passed"] > 0, \
        f"{kind}: the reference passes {case}, but: {reference['cases']}"
