"""Command line: ``python -m course_lib demo`` (the main job), ``serve`` (the HTTP server) and friends."""
from __future__ import annotations

import argparse
import sys


def demo(args) -> int:
    """A hot update landing mid-generation, on one screen (see course_lib/demo.py)."""
    from course_lib.demo import main as run_demo
    return run_demo(mode=args.mode, device=args.device, seed=args.seed, preset=args.preset)


def serve(args) -> int:
    """Serve a checkpoint over HTTP (SGLang's weight-sync protocol); needs the [server] extra."""
    from course_lib.server.runner import serve as run_server
    return run_server(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="a hot weight update landing mid-generation: versions, timings, hot == cold")
    p.add_argument("--mode", default="retract", choices=["retract", "keep", "abort", "wait"],
                   help="how the pause treats requests in flight (default retract)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when torch sees a GPU")
    p.add_argument("--seed", type=int, default=0, help="v1 is made from this seed, v2 from seed + 1")
    p.add_argument("--preset", default="tiny", help="checkpoint size (course_lib.weights.checkpoint.PRESETS)")
    p.set_defaults(func=demo)
    p = sub.add_parser("serve", help="serve a checkpoint over HTTP (SGLang's weight-sync protocol)")
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint directory")
    p.add_argument("--allow-weight-update", action="store_true",
                   help="enable the weight routes (pause, continue, updates, groups, versions)")
    p.add_argument("--api-key", default=None, help="require this key on every route but /health "
                   "(or set COURSE_LIB_API_KEY)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed at start-up)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"])
    p.add_argument("--max-body-mb", type=float, default=64.0, help="larger request bodies get 413")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=serve)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
