"""Chapter 01 in JupyterLab, in a real (headless) browser, as a learner would run it.

Serves JupyterLab on 127.0.0.1 (a free port, a random token) over a copy of the chapter,
opens it in Debian's Chromium driven by Playwright, clicks Run → Run All Cells, and waits
until every code cell has run. No cell may show an error, and the plots must render as
images. A screenshot is saved under pytest's temp dir and its path printed.

Skipped, with the reason, where Chromium or Playwright is missing (never passed):
``apt-get install chromium`` and ``pip install playwright`` (the dev extra) provide them.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHAPTER = REPO / "notebooks" / "01_the_engine.ipynb"
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
RUN_LIMIT_S = 240
BROKEN = "broken.ipynb"
BROKEN_NOTEBOOK = {
    "nbformat": 4, "nbformat_minor": 5,
    "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    "cells": [{"cell_type": "code", "id": f"c{i}", "metadata": {}, "outputs": [], "execution_count": None,
               "source": src} for i, src in enumerate(["print('fine')", "1 / 0", "print('never runs')"])],
}

# JupyterLab user settings for a quiet, deterministic page: every cell in the DOM (no
# windowing), no news or update checks (there is no network).
SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                         "checkForUpdates": False},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyterlab(tmp_path):
    """(base url, token) of a JupyterLab serving a folder that holds a copy of chapter 01."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium): the browser test did not run")
    pytest.importorskip("playwright", reason="playwright is not installed (pip install playwright)")
    pytest.importorskip("jupyterlab")
    served = tmp_path / "served"
    served.mkdir()
    shutil.copy(CHAPTER, served)
    (served / BROKEN).write_text(json.dumps(BROKEN_NOTEBOOK))
    settings = tmp_path / "lab-settings"
    for name, value in SETTINGS.items():
        (settings / Path(name).parent).mkdir(parents=True, exist_ok=True)
        (settings / name).write_text(json.dumps(value))
    env = {k: v for k, v in os.environ.items() if k not in ("MPLBACKEND", "COURSE_HIDDEN_DIR")}
    # The copy sits outside the repository: its graded cells are told where the judge and the
    # course_lib they grade are (as the environment variables of judging/notebook.py allow).
    env.update(COURSE_PRACTICE_DIR=str(REPO / "practice"), COURSE_SUBMISSION_ROOT=str(REPO))
    env.update(JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
               JUPYTERLAB_SETTINGS_DIR=str(settings), JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"),
               MPLCONFIGDIR=str(tmp_path / "mpl"))
    port, token = free_port(), secrets.token_hex(16)
    log = open(tmp_path / "jupyterlab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
         f"--ServerApp.root_dir={served}", f"--IdentityProvider.token={token}",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        cwd=served, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert server.poll() is None, f"JupyterLab exited: {(tmp_path / 'jupyterlab.log').read_text()[-2000:]}"
            try:
                request = urllib.request.Request(f"{base}/api/status", headers={"Authorization": f"token {token}"})
                with urllib.request.urlopen(request, timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "JupyterLab did not answer within 90 s"
                time.sleep(0.5)
        yield base, token
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def dismiss_dialogs(page) -> None:
    """Close a modal dialog that would take the next click (on a loaded machine JupyterLab may
    show one, e.g. about a slow server connection), printing its text: the run's results are
    still checked in full afterwards."""
    dialogs = page.locator(".jp-Dialog")
    for _ in range(3):
        if not dialogs.count():
            return
        print(f"closed a JupyterLab dialog: {dialogs.first.inner_text()[:300]!r}")
        buttons = dialogs.first.locator(".jp-Dialog-button.jp-mod-accept")
        if buttons.count():
            buttons.first.click()
        else:
            page.keyboard.press("Escape")
        time.sleep(1)


def run_all_cells(page, url: str) -> dict:
    """Open a notebook, click Run > Run All Cells, wait until nothing runs; report what shows."""
    page.goto(url)
    page.wait_for_selector(".jp-Notebook .jp-CodeCell", timeout=60_000)
    idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")
    idle.wait_for(timeout=90_000)  # the kernel has started
    prompts = page.locator(".jp-Notebook .jp-CodeCell .jp-InputArea-prompt")
    start, clicks = time.monotonic(), 0
    while True:  # done when nothing is queued or running ("[*]:") and the kernel is idle
        texts = [t.strip() for t in prompts.all_inner_texts()]
        started = any(t == "[*]:" or t[1:-2].isdigit() for t in texts)
        if not started and clicks < 3 and time.monotonic() - start >= 20 * clicks:
            # Run All, again if nothing has started 20 s after the last click: on a loaded
            # machine a click on the menu can land before the page handles it.
            dismiss_dialogs(page)
            page.click(".lm-MenuBar-itemLabel:text-is('Run')")
            page.click(".lm-Menu-item[data-command='runmenu:run-all']")
            clicks += 1
        time.sleep(1)
        texts = [t.strip() for t in prompts.all_inner_texts()]
        if texts and "[*]:" not in texts and idle.count() and any(t[1:-2].isdigit() for t in texts):
            break
        assert time.monotonic() - start < RUN_LIMIT_S, (f"cells still running after {RUN_LIMIT_S} s "
                                                        f"({clicks} Run All clicks; prompts {texts[:12]}; "
                                                        f"kernel idle: {bool(idle.count())})")
    # An error renders as a stderr output that holds a traceback (warnings are stderr too).
    stderr = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    images = page.locator(".jp-OutputArea-output[data-mime-type='image/png'] img")
    if images.count():
        images.nth(min(2, images.count() - 1)).scroll_into_view_if_needed()
    return {
        "seconds": time.monotonic() - start,
        "errors": [t for t in stderr.all_inner_texts() if "Traceback" in t],
        "not_run": [i for i, t in enumerate(texts) if not t[1:-2].isdigit()],
        "cells": len(texts),
        "plots": images.evaluate_all("imgs => imgs.filter(i => i.complete && i.naturalWidth > 100).length"),
    }


def test_chapter_01_runs_in_jupyterlab(jupyterlab, tmp_path, capsys):
    from playwright.sync_api import sync_playwright

    base, token = jupyterlab
    shot = tmp_path / "chapter01.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            # First prove the checks can fail: a notebook whose second cell raises.
            broken = run_all_cells(page, f"{base}/lab/workspaces/broken/tree/{BROKEN}?token={token}")
            page.close()
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            run = run_all_cells(page, f"{base}/lab/workspaces/chapter/tree/{CHAPTER.name}?token={token}")
            page.screenshot(path=str(shot))
        finally:
            browser.close()
    with capsys.disabled():
        print(f"\n[browser] chapter 01 ran in JupyterLab in {run['seconds']:.1f} s; screenshot: {shot}")
    assert broken["errors"] and "ZeroDivisionError" in broken["errors"][0] and broken["not_run"] == [2], broken
    assert not run["errors"], f"a cell shows an error:\n{run['errors'][0][:3000]}"
    assert not run["not_run"], f"code cells {run['not_run']} of {run['cells']} did not run"
    assert run["plots"] >= 4, f"only {run['plots']} plots rendered as images"
