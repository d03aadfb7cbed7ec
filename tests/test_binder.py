"""binder/ (the mybinder environment): what can be checked without building the image.

pip parses binder/requirements.txt and the postBuild install line (``.[course]``) and
finds them satisfied here, without the network; the torch pin is the one scripts/setup.sh
uses; the scripts are executable, valid bash, and start by running the server command.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BINDER = REPO / "binder"


def requirement_lines():
    lines = [line.split("#")[0].strip() for line in (BINDER / "requirements.txt").read_text().splitlines()]
    return [line for line in lines if line]


def test_requirements_are_well_formed_and_cpu_only():
    from packaging.requirements import Requirement

    lines = requirement_lines()
    options = [line for line in lines if line.startswith("-")]
    reqs = {Requirement(line).name: Requirement(line) for line in lines if not line.startswith("-")}
    assert options == ["--extra-index-url https://download.pytorch.org/whl/cpu"], "the CPU wheel index, and nothing else"
    assert "torch" in reqs, "binder must pin torch (a bare torch pulls a CUDA build)"
    setup_pin = re.search(r'torch==([0-9.]+)', (REPO / "scripts" / "setup.sh").read_text()).group(1)
    assert str(reqs["torch"].specifier) == f"=={setup_pin}", "binder's torch pin differs from scripts/setup.sh"


def test_pip_resolves_binder_requirements_offline(tmp_path):
    """Satisfied by this environment (installed from the same pins), so no index is contacted."""
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-build-isolation",
           "--report", str(report), "-r", str(BINDER / "requirements.txt"), "-e", f"{REPO}[course]"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stdout + run.stderr
    would_install = {item["metadata"]["name"] for item in json.loads(report.read_text())["install"]}
    assert would_install <= {"course-lib"}, f"binder would need packages this environment lacks: {would_install}"


@pytest.mark.parametrize("script", ["postBuild", "start"])
def test_scripts_are_executable_bash(script):
    path = BINDER / script
    assert path.stat().st_mode & 0o111, f"binder/{script} must be executable"
    assert path.read_text().startswith("#!/usr/bin/env bash\n")
    run = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_start_runs_the_command_it_is_given():
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    run = subprocess.run([str(BINDER / "start"), "bash", "-c", "echo launched $OMP_NUM_THREADS"],
                         capture_output=True, text=True, timeout=30, env=env)
    assert run.returncode == 0 and run.stdout.strip() == "launched 2", run.stdout + run.stderr


def test_postbuild_installs_the_course_and_opens_chapter_one():
    text = (BINDER / "postBuild").read_text()
    assert 'pip install --no-cache-dir -e ".[course]"' in text
    opened = re.search(r'default_url = "/lab/tree/(.+?)"', text).group(1)
    assert (REPO / opened).is_file(), f"postBuild opens {opened}, which does not exist"
    assert (BINDER / "runtime.txt").read_text().strip() == "python-3.11"
