"""For running the chapters' public tests with plain pytest (``python -m pytest practice/chapters``).

The judge (``python practice/judge.py test chNN``) is the grader: it runs these tests in
a fresh process against the course_lib it is told to grade and never counts a case that
did not run. This file only lets plain pytest run them too: it registers the markers and
reports GPU cases as skipped where there is no GPU.
"""
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "exercise(id): the chapter exercise (chNN.name) this case grades")
    config.addinivalue_line("markers", "cuda: needs an NVIDIA GPU")


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        for item in items:
            if item.get_closest_marker("cuda"):
                item.add_marker(pytest.mark.skip(reason="needs CUDA (not graded here)"))
