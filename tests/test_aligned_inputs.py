"""The model runner's int64 inputs start at 16-byte boundaries whatever the batch, so a
Triton kernel meets one alignment of its pointer arguments and is compiled once, at
start-up. Packed back to back, an eager prefill whose token count was odd moved every
input after the token ids by 8 bytes, a specialization the captured graphs never met,
compiled mid-serving with every stream waiting. On a GPU, no prefill of any shape compiles
anything after start-up."""
import random

import pytest
import torch

from course_lib import Engine
from course_lib.engine.model_runner import aligned_offsets, pack_aligned


def allocated(engine, lengths):
    """Queued sequences of these prompt lengths, their KV blocks allocated."""
    seqs = []
    for n in lengths:
        rid = engine.add_request(input_ids=[1 + i % 200 for i in range(n)], sampling_params={"max_new_tokens": 1})
        seqs.append(engine.requests[rid])
        engine.scheduler.block_manager.allocate(seqs[-1])
    return seqs


def test_every_input_of_a_prefill_or_decode_starts_at_16_bytes(make_ckpt):
    engine = Engine(make_ckpt("tiny", seed=95), max_num_seqs=16)
    runner, rng = engine.model_runner, random.Random(0)
    for _ in range(40):  # batches of every parity of tokens and sequences
        seqs = allocated(engine, [rng.randint(1, 40) for _ in range(rng.randint(1, 7))])
        ids, pos, meta, last = runner.prepare_prefill(seqs)
        prefill = {"ids": ids, "positions": pos, "slots": meta.slot_mapping, "context_lens": meta.context_lens,
                   "block_tables": meta.block_tables, "query_starts": meta.query_starts, "last": last}
        ids, pos, meta = runner.prepare_decode(seqs)
        decode = {"ids": ids, "positions": pos, "slots": meta.slot_mapping, "context_lens": meta.context_lens,
                  "block_tables": meta.block_tables}
        for where, inputs in (("prefill", prefill), ("decode", decode)):
            off = {k: t.data_ptr() % 16 for k, t in inputs.items()}
            assert not any(off.values()), f"{where} of {[s.num_tokens for s in seqs]} tokens: offsets {off}"
        for seq in seqs:
            engine.abort_request(seq.rid, "test", "abort")
        engine.step()


def test_a_packed_buffer_holds_each_input_where_aligned_offsets_says():
    g = torch.Generator().manual_seed(1)
    for sizes in ([16, 16, 16, 32, 32 * 64, 33, 32], [5, 5, 5, 3, 3 * 7, 4, 3], [1], [0, 3, 2]):
        tensors = [torch.randint(0, 1000, (n,), generator=g) for n in sizes]
        offsets, total = aligned_offsets(sizes)
        flat = pack_aligned(tensors)
        assert flat.numel() == total and all(o % 2 == 0 for o in offsets)
        for o, t in zip(offsets, tensors):
            assert torch.equal(flat[o:o + t.numel()], t)


@pytest.mark.cuda
def test_no_prefill_compiles_a_kernel_after_start_up(make_ckpt):
    """Prefills of odd and even token and sequence counts, padded into the captured graphs
    and eager (over 512 tokens, or over 32 sequences), after the engine started: Triton's
    compile hooks see nothing."""
    pytest.importorskip("triton")
    from course_lib.server.step_trace import CompileLog

    engine = Engine(make_ckpt("tiny", seed=96), device="cuda", max_num_seqs=64, max_model_len=1024)
    log = CompileLog()
    assert log.available, "this Triton has no compile hooks (3.4 or newer has)"
    rng, params = random.Random(2), {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
    batches = [[7], [8], [3, 4], [5, 6, 6], [601], [600], [300, 301], [300, 302], [300, 300, 1],
               [rng.randint(10, 60) for _ in range(33)], [rng.randint(10, 60) for _ in range(34)],
               [rng.randint(100, 200) for _ in range(9)], [rng.randint(100, 200) for _ in range(10)]]
    log.install()
    try:
        for lengths in batches:  # random tokens: no prompt finds another's in the prefix cache
            engine.generate(input_ids=[[rng.randint(1, 500) for _ in range(n)] for n in lengths],
                            sampling_params=params)
    finally:
        log.remove()
    assert not log.records, [(r["kernel"], r["unaligned"], round(r["t1"] - r["t0"], 3)) for r in log.records]
