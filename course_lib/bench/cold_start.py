"""A cold start of the engine, phase by phase, in this fresh process (run by file path).

    python course_lib/bench/cold_start.py CHECKPOINT --device cuda --spawned-at <time.time()>

Run by path rather than ``-m`` so that nothing (not even torch) is imported before the
first timestamp. Prints one JSON line: seconds per phase, from the parent's spawn time.
"""
import time

T_FIRST_LINE = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("--device", default="cpu")
    p.add_argument("--spawned-at", type=float, required=True)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=16)
    args = p.parse_args()
    phases = {"process_start": T_FIRST_LINE - args.spawned_at}
    t = time.time()
    import torch
    phases["import_torch"] = time.time() - t
    t = time.time()
    from course_lib import Engine
    phases["import_course_lib"] = time.time() - t
    t = time.time()
    if args.device.startswith("cuda"):
        torch.cuda.init()
        torch.empty(1, device=args.device).add_(1)
        torch.cuda.synchronize()
    phases["device_init"] = time.time() - t
    engine = Engine(args.checkpoint, device=args.device, max_model_len=args.max_model_len,
                    max_num_seqs=args.max_num_seqs)
    phases["load_weights"] = engine.timings["load_weights_s"]
    phases["kv_pool_and_graph_capture"] = engine.timings["kv_and_graphs_s"]
    t = time.time()
    engine.generate("first token", {"max_new_tokens": 1, "temperature": 0})
    phases["first_token"] = time.time() - t
    phases["total"] = time.time() - args.spawned_at
    print(json.dumps(phases))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
