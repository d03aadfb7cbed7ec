"""Benchmarks. Each prints ratios against a baseline measured in the same run; none runs in
the unit tests. ``python -m course_lib.bench <name> --help``."""
