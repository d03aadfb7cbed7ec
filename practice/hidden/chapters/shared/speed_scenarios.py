"""The speed tier's measurements: one part of the engine timed on the GPU, beside a device
copy of the same bytes measured in the same process (judging/speed.py runs each scenario
on the learner's course_lib and on the reference's, alternately, in the same run).

Every round draws new values (a cached result cannot be reused), the part's output is
checked bitwise (or for the right shapes and dtypes) after the timed call, and a figure
faster than the device copy of the same bytes is impossible: it is reported, never scored.
Timings come from CUDA events around the call, after the device is idle.
"""
from __future__ import annotations

import statistics

import torch


def _time_ms(fn) -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _copy_ms(nbytes: int, rounds: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm
    return statistics.median(_time_ms(lambda: dst.copy_(src)) for _ in range(rounds))


def _result(ms: list[float], nbytes: int, rounds: int, correct: bool, why: str = "") -> dict:
    copy = _copy_ms(nbytes, rounds)
    part = statistics.median(ms)
    return {"gbps": nbytes / part / 1e6, "copy_gbps": nbytes / copy / 1e6, "ms": part, "copy_ms": copy,
            "bytes": nbytes, "rounds": rounds, "correct": correct, "why": why}


def commit(rounds: int = 5, layers: int = 8, hidden: int = 2048) -> dict:
    """The commit step (chapter 04): new device tensors for every weight, copied in place
    (~1 GB in bf16); afterwards one unfused weight per round is compared bitwise."""
    import tempfile

    from course_lib import Engine
    from course_lib.models.qwen3 import hf_tensor_shapes
    from course_lib.weights.checkpoint import make_random, preset
    from course_lib.weights.commit.copy_plan import copy_in_place

    config = preset("qwen3-0.6b", num_hidden_layers=layers, hidden_size=hidden, intermediate_size=3 * hidden,
                    vocab_size=32768, bos_token_id=1, eos_token_id=2)
    with tempfile.TemporaryDirectory() as d:
        engine = Engine(make_random(f"{d}/m", config, seed=1, device="cuda"), device="cuda",
                        enable_cuda_graph=False, max_model_len=256)
    shapes = hf_tensor_shapes(config)
    ms, correct, why = [], True, ""
    for r in range(rounds):
        gen = torch.Generator(device="cuda").manual_seed(1000 + r)
        pairs = [(n, torch.randn(s, generator=gen, device="cuda", dtype=torch.bfloat16)) for n, s in shapes.items()]
        nbytes = sum(t.numel() * t.element_size() for _, t in pairs)
        ms.append(_time_ms(lambda: copy_in_place(engine.model, pairs, "cuda")))
        name = f"model.layers.{r % layers}.mlp.down_proj.weight"
        live = engine.model.get_parameter(engine.model.map_checkpoint_name(name)[0])
        if not torch.equal(live, dict(pairs)[name]):
            correct, why = False, f"{name} does not hold the new values after the commit step"
    return _result(ms, nbytes, rounds, correct, why)


def sender(rounds: int = 5, total_mb: int = 512, bucket_mb: int = 64) -> dict:
    """The bucket sender (chapter 05): device tensors packed into reused buffers, each payload
    handed over (serialized) and released, as a trainer does every step."""
    from course_lib.weights.transports import bucket
    from course_lib.weights.transports.ipc import BucketSender

    n = 32
    numel = total_mb * (1 << 20) // 2 // n
    snd = BucketSender(bucket_bytes=bucket_mb << 20, device="cuda")
    ms, correct = [], True
    for r in range(rounds):
        gen = torch.Generator(device="cuda").manual_seed(2000 + r)
        pairs = [(f"w{i}", torch.randn(numel, generator=gen, device="cuda", dtype=torch.bfloat16)) for i in range(n)]
        nbytes = sum(t.numel() * t.element_size() for _, t in pairs)
        last = {}

        def run():
            for receipt, payload in snd.payloads(pairs):
                last["receipt"] = receipt
                snd.release(receipt)

        ms.append(_time_ms(run))
        correct = correct and snd.num_alive == 0 and "receipt" in last
    return _result(ms, nbytes, rounds, correct)


def requantize(rounds: int = 5, rows: int = 8192, cols: int = 8192) -> dict:
    """FP8 block quantization (chapter 03), the kernel a requantizing update runs per weight."""
    from course_lib.layers.quant import quantize_fp8_block

    ms, correct = [], True
    for r in range(rounds):
        gen = torch.Generator(device="cuda").manual_seed(3000 + r)
        w = torch.randn(rows, cols, generator=gen, device="cuda", dtype=torch.bfloat16)
        out = {}
        ms.append(_time_ms(lambda: out.update(q=quantize_fp8_block(w))))
        q, scale = out["q"]
        correct = correct and q.shape == w.shape and q.dtype == torch.float8_e4m3fn and q.is_cuda
    return _result(ms, rows * cols * 2, rounds, correct)
