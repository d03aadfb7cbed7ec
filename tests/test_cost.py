"""Cost proxies (course_lib/cost.py, judge.py cost): what they count, and that each chapter's
recorded reference counts are the instructor edition's counts today."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from course_lib.cost import count_costs

REPO = Path(__file__).resolve().parents[1]
COST_FILES = sorted((REPO / "practice" / "chapters").glob("ch*/cost.py"))


def test_counts_copies_allocations_and_host_waits():
    a, b = torch.zeros(1000), torch.ones(1000)

    def work():
        a.copy_(b)                      # a copy, in place: no allocation
        c = b * 2                       # an operation with a new result: 4 kB
        a.view(10, 100)                 # a view: neither
        return float(c.sum().item())    # reading a value back: the host waits
    costs, result = count_costs(work)
    assert result == 2000.0
    assert (costs.copies, costs.host_waits) == (1, 1)
    assert costs.allocations == 2 and costs.allocated_bytes >= 4000  # c, and the sum's one element
    assert costs.ops == 5


def test_grouped_copies_are_one_call_and_meta_tensors_are_free():
    dsts, srcs = [torch.zeros(4) for _ in range(8)], [torch.ones(4) for _ in range(8)]
    grouped, _ = count_costs(lambda: torch._foreach_copy_(dsts, srcs))
    one_by_one, _ = count_costs(lambda: [d.copy_(s) for d, s in zip(dsts, srcs)])
    assert (grouped.copies, one_by_one.copies) == (1, 8)
    meta, _ = count_costs(lambda: torch.empty(10_000, 10_000, device="meta") + 1)
    assert meta.ops == meta.allocations == meta.allocated_bytes == 0


@pytest.mark.parametrize("path", COST_FILES, ids=[p.parent.name for p in COST_FILES])
def test_the_recorded_reference_counts_are_todays(path):
    """REFERENCE is what the instructor edition counts now: a change to a part that makes
    it cost more or less shows here, and the file is updated with it."""
    code = (f"import importlib.util, json; spec = importlib.util.spec_from_file_location('c', {str(path)!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "from course_lib.cost import count_costs; print(json.dumps(count_costs(m.scenario())[0].as_dict()))")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-2000:]
    spec_globals = {}
    exec(compile(path.read_text(), str(path), "exec"), spec_globals)
    assert json.loads(run.stdout.splitlines()[-1]) == spec_globals["REFERENCE"]


def test_judge_cost_prints_the_counts_beside_the_reference_and_a_slower_design_shows(tmp_path):
    """A correct commit step with one copy per tensor counts more copies than the reference."""
    slow = tmp_path / "slow.py"
    slow.write_text("pairs = list(named_tensors)\n"
                    "for name, t in pairs:\n"
                    "    if name not in self.views:\n"
                    "        raise KeyError(name)\n"
                    "    view = self.views[name]\n"
                    "    if view is not None and view.shape != t.shape:\n"
                    "        raise ValueError(name)\n"
                    "for name, t in pairs:\n"
                    "    if self.views[name] is not None:\n"
                    "        self.views[name].copy_(t)\n")
    sys.path.insert(0, str(REPO / "practice"))
    try:
        from judging.checks import variant_root  # a copy of this course with the region's body replaced
    finally:
        sys.path.remove(str(REPO / "practice"))
    root = variant_root(REPO, "ch04.copy_in_place", slow.read_text())
    try:
        run = subprocess.run([sys.executable, "practice/judge.py", "cost", "ch04", "--root", str(root)], cwd=REPO,
                             capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert run.returncode == 0, run.stdout + run.stderr
    copies = next(line for line in run.stdout.splitlines() if "copy calls" in line)
    mine, ref = (int(x.replace(",", "")) for x in copies.split()[2:4])
    assert mine > ref and "more than the reference" in copies
