"""Compare the two GPU read paths for one checkpoint (pinned parallel reads vs plain), same run.

    python scripts/disk_read_ab.py --preset qwen3-1.7b
"""
import argparse
import os
import tempfile
import time

import torch

from course_lib.weights.checkpoint import CheckpointReader, make_random


def read_all(reader) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _, t in reader.iter_tensors(device="cuda"):
        del t
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-1.7b")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = make_random(f"{tmp}/c", args.preset, device="cuda")
        reader = CheckpointReader(path)
        gb = reader.nbytes() / 1e9
        for _ in range(2):
            for mode in ("1", "0"):
                os.environ["COURSE_LIB_PINNED_READER"] = mode
                s = read_all(reader)
                print(f"{'pinned parallel' if mode == '1' else 'plain':>16}: {gb / s:6.1f} GB/s ({s:.2f} s for {gb:.2f} GB)")


if __name__ == "__main__":
    main()
