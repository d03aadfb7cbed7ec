"""The graphs benchmark: on a CPU it says it needs CUDA and writes nothing; on a GPU the
rebinding bug shows in graph replay (not in eager decode), the in-place update does not,
and the audit tells them apart."""
import json
import subprocess
import sys

import pytest
import torch

from course_lib.bench import graphs


def test_without_cuda_it_says_so_and_writes_nothing(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the GPU test below covers it")
    out = tmp_path / "graphs.json"
    run = subprocess.run([sys.executable, "-m", "course_lib.bench", "graphs", "--json", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "needs CUDA" in run.stdout
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.cuda
def test_rebinding_shows_in_graph_replay_only(tmp_path):
    out = tmp_path / "graphs.json"
    graphs.main(["--steps", "10", "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["cuda_graphs"] and r["hardware"]
    assert r["rebind"]["graph_max_abs_diff_vs_cold"] > 0 and not r["rebind"]["greedy_equals_cold"]
    assert r["rebind"]["eager_max_abs_diff_vs_cold"] == 0  # eager reads the new memory: the bug hides
    assert r["rebind"]["audit"].startswith("AddressMovedError")
    assert r["in_place"]["graph_max_abs_diff_vs_cold"] == 0 and r["in_place"]["greedy_equals_cold"]
    assert r["in_place"]["audit"] == "clean"
    assert r["timing"]["graph_ms_per_step"] > 0 and r["timing"]["eager_ms_per_step"] > 0
