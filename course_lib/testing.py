"""Oracles that tests, chapters and the judge's hidden tests share.

``prompt_logits`` reads logits at every prompt position through the engine's own prefill
path (paged KV and all), so it can be compared with transformers or with another engine.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from course_lib.engine.sequence import SamplingParams, Sequence


# A small model for GPU tests whose dimensions are multiples of 128, so FP8-block layers
# take the real FP8 matmul and the fused requantization kernels see whole tiles.
GPU_TEST_SHAPE = dict(hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=512, torch_dtype="bfloat16")


def prompt_logits(engine, input_ids: list[int]) -> torch.Tensor:
    """Logits [len(input_ids), vocab_size] (float32, CPU) computed by ``engine``'s prefill.

    Uses fresh KV blocks and no prefix-cache hits, so it reflects the current weights
    only; it does not disturb requests in flight.
    """
    ids = [int(t) for t in input_ids]
    if not ids:
        raise ValueError("input_ids is empty")
    if len(ids) > engine.config.max_model_len:
        raise ValueError(f"{len(ids)} tokens exceed max_model_len={engine.config.max_model_len}")
    seq = Sequence(ids, SamplingParams(temperature=0), engine.config.block_size)
    bm = engine.block_manager
    if not bm.can_allocate(seq):
        raise RuntimeError(f"not enough free KV blocks for {len(ids)} tokens")
    bm.allocate(seq, use_cache=False)
    try:
        return engine.model_runner.prefill_all_logits(seq).float().cpu()
    finally:
        bm.deallocate(seq)


def greedy_tokens(engine, prompts: list[str], max_new_tokens: int = 8) -> list[list[int]]:
    out = engine.generate(prompts, {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True})
    return [o["output_ids"] for o in out]


def cold_engine_like(engine, checkpoint_path):
    """A new engine cold-started on ``checkpoint_path`` with ``engine``'s own config
    (read from disk even when ``engine`` started with ``load_format="dummy"``)."""
    from course_lib import Engine
    if engine.config.tp_size > 1:
        raise ValueError("cold_engine_like builds one process's engine; for a tensor-parallel engine "
                         "start a TPEngine on the checkpoint instead")
    return Engine(checkpoint_path, config=replace(engine.config, load_format="auto"))


def assert_hot_equals_cold(engine, checkpoint_path, prompts: list[str], max_new_tokens: int = 8,
                           cold=None) -> None:
    """The first contract: ``engine`` (hot-updated) computes exactly what an engine
    cold-started on ``checkpoint_path`` computes: bitwise-equal prompt logits and equal
    greedy tokens (through the decode path, CUDA graphs included when enabled)."""
    cold = cold or cold_engine_like(engine, checkpoint_path)
    for prompt in prompts:
        ids = engine.tokenizer.encode(prompt)
        hot_logits, cold_logits = prompt_logits(engine, ids), prompt_logits(cold, ids)
        if not torch.equal(hot_logits, cold_logits):
            diff = (hot_logits - cold_logits).abs().max().item()
            raise AssertionError(f"hot != cold: prompt logits differ for {prompt!r} (max abs diff {diff:.3e})")
    hot_tokens, cold_tokens = greedy_tokens(engine, prompts, max_new_tokens), greedy_tokens(cold, prompts, max_new_tokens)
    if hot_tokens != cold_tokens:
        raise AssertionError(f"hot != cold: greedy tokens differ: {hot_tokens} vs {cold_tokens}")


def assert_addresses_unchanged(engine) -> None:
    """The second contract: no tensor a kernel reads has moved since the engine started."""
    engine.verify_addresses()


@contextlib.contextmanager
def plugged_commit(engine, load_into):
    """While active, ``engine``'s updates commit validated tensors with
    ``load_into(model, named_tensors)`` (tensors already on the engine's device) instead
    of the engine's own commit step, wherever a commit step writes (the general writer,
    the layer-by-layer reload); the fast writers that would stand in for it stand aside.
    Everything around it (validation, requests, post-processing, the address audit,
    versions) stays the engine's. The hook exercises and graders plug learners' code into
    (an engine built with ``Engine(..., commit=...)`` takes one for good)."""
    def commit(model, named_tensors, device):
        load_into(model, [(name, t.to(device)) for name, t in named_tensors])

    original, engine.updater.commit = engine.updater.commit, commit  # the course's hooks are read again
    try:
        yield
    finally:
        engine.updater.commit = original


def random_partition(rng, shape, n: int) -> list[tuple]:
    """Up to ``n`` disjoint boxes (``((start, end), ...)`` per dimension) that together
    cover a tensor of ``shape``, cut at random places along random dimensions: random
    explicit layouts for the resharding planner's tests and graders."""
    boxes = [tuple((0, s) for s in shape)]
    while len(boxes) < n:
        cuttable = [b for b in boxes if any(z - a > 1 for a, z in b)]
        if not cuttable:
            break
        box = rng.choice(cuttable)
        dim = rng.choice([d for d, (a, z) in enumerate(box) if z - a > 1])
        a, z = box[dim]
        cut = rng.randrange(a + 1, z)
        boxes.remove(box)
        boxes += [tuple((a, cut) if d == dim else r for d, r in enumerate(box)),
                  tuple((cut, z) if d == dim else r for d, r in enumerate(box))]
    rng.shuffle(boxes)
    return boxes


def serve_checkpoint(checkpoint_path, master_port: int, results=None, group_name: str = "remote_seed",
                     bucket_bytes: int | None = None, **engine_options) -> None:
    """A seeding source in a process of its own: start an engine on ``checkpoint_path`` and
    seed one new engine (``Engine.send_weights_to_remote``). Module-level so
    ``multiprocessing`` can spawn it; ``results`` (a queue) gets the stats or the error."""
    from course_lib import Engine
    from course_lib.weights.transports.remote import RemoteSeedError

    engine = Engine(checkpoint_path, **engine_options)
    try:
        stats = engine.send_weights_to_remote("127.0.0.1", master_port, group_name=group_name,
                                              bucket_bytes=bucket_bytes)
    except RemoteSeedError as exc:
        if results is not None:
            results.put({"error": str(exc)})
        return
    if results is not None:
        results.put(stats)


def verdict(tests, *component) -> Exception | None:
    """What a test-writing part's ``tests(*component)`` says of a component: None when the
    tests pass (return quietly), else the error they raised. A part not written yet (its
    stub raises NotImplementedError saying "write this part") is raised again: an
    unwritten test catches nothing."""
    try:
        tests(*component)
    except NotImplementedError as exc:
        if "write this part" in str(exc):
            raise
        return exc
    except Exception as exc:  # noqa: BLE001 - any failure of the tests is their verdict on the component
        return exc
    return None
