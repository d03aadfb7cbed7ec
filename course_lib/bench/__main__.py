"""``python -m course_lib.bench <benchmark> [options]``."""
import importlib
import sys

BENCHMARKS = {"decode": "course_lib.bench.decode", "update": "course_lib.bench.update", "graphs": "course_lib.bench.graphs",
              "hot-vs-cold": "course_lib.bench.hot_vs_cold", "transports": "course_lib.bench.transports",
              "copy-kernels": "course_lib.bench.copy_kernels", "serve-load": "course_lib.bench.serve_load"}


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHMARKS:
        print(f"usage: python -m course_lib.bench {{{','.join(BENCHMARKS)}}} [options]", file=sys.stderr)
        return 2
    importlib.import_module(BENCHMARKS[sys.argv[1]]).main(sys.argv[2:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
