"""Command line: ``python -m course_lib demo`` (the main job), ``serve`` (the HTTP server) and friends."""
from __future__ import annotations

import argparse
import sys
import tempfile
import time


def demo(args) -> int:
    """Make a tiny checkpoint, start the engine, generate, and show where the time went."""
    import torch

    from course_lib import Engine
    from course_lib.weights.checkpoint import make_random

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = make_random(f"{tmp}/ckpt", args.preset, seed=0)
        print(f"made a random '{args.preset}' Qwen3 checkpoint in {time.perf_counter() - t0:.2f} s: {path}")
        engine = Engine(path, device=device)
        print(f"engine started on {device} in {engine.timings['startup_s']:.2f} s "
              f"(weights {engine.timings['load_weights_s']:.3f} s, KV pool + graphs {engine.timings['kv_and_graphs_s']:.3f} s)")
        prompts = ["Hot weight updates", "The engine keeps its graphs", "Hot weight updates keep the process"]
        t0 = time.perf_counter()
        outs = engine.generate(prompts, {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True})
        dt = time.perf_counter() - t0
        for p, o in zip(prompts, outs):
            m = o["meta_info"]
            print(f"  {p!r} -> {o['output_ids'][:8]}... ({m['completion_tokens']} tokens, "
                  f"{m['cached_tokens']} prompt tokens from the prefix cache, version {m['weight_version']})")
        n = sum(len(o["output_ids"]) for o in outs)
        print(f"generated {n} tokens in {dt:.2f} s ({n / dt:.0f} tokens/s); "
              f"prefix cache: {engine.prefix_cache_stats}")
        print("(random weights: the token ids mean nothing; tests compare them with transformers)")
    return 0


def serve(args) -> int:
    """Serve a checkpoint over HTTP (SGLang's weight-sync protocol); needs the [server] extra."""
    from course_lib.server.runner import serve as run_server
    return run_server(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="generate with a tiny random checkpoint and print timings")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default=None)
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
