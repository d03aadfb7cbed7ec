"""Benchmarks. Each prints ratios against a baseline measured in the same run; none runs in
the unit tests. ``python -m course_lib.bench <name> --help``."""
from __future__ import annotations

import json
import os
import platform
from datetime import date

import torch

from course_lib.config import is_cuda


def run_header(benchmark: str, device: str, **fields) -> dict:
    """What every recorded result states: which benchmark, on what hardware, when."""
    gpu = is_cuda(device)
    return {"benchmark": benchmark, "device": device, "date": date.today().isoformat(),
            "hardware": torch.cuda.get_device_name() if gpu else cpu_name(),
            "torch": torch.__version__, **fields}


def cpu_name() -> str:
    """The CPU's model name and core count (from /proc/cpuinfo where there is one)."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} cores"


def save_json(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
