"""Live loads for the pause-mode-bookkeeping tests: an engine mid-decode, its requests as
``pause_ledger`` receives them, and what the engine itself counts for a pause.

``measured_ledger`` is the truth every test compares with: it pauses the engine in the
given mode, updates its weights from another checkpoint, continues, runs every request to
the end, and returns the fields of ``engine.pause_stats[-1]`` that ``pause_ledger``
predicts.
"""
from __future__ import annotations

import torch

from course_lib import Engine
from course_lib.engine.sequence import SequenceStatus

LEDGER_KEYS = ("aborted_requests", "discarded_tokens", "retracted_requests", "reprefill_tokens",
               "mixed_requests", "kv_fresh")

# Tiny matrices: on a shared 2-core machine more threads only wait for each other.
torch.set_num_threads(1)


def live_engine(path, load, steps: int, **engine_kwargs) -> Engine:
    """An engine on ``path`` that has run ``steps`` steps of ``load``: a list of
    (arrival step, prompt token ids, sampling params)."""
    engine = Engine(path, **engine_kwargs)
    for step in range(steps):
        for at, prompt, params in load:
            if at == step:
                engine.add_request(input_ids=list(prompt), sampling_params=dict(params))
        engine.step()
    return engine


def unfinished_requests(engine: Engine) -> list[dict]:
    """The engine's unfinished requests in arrival order, as ``pause_ledger`` receives them."""
    return [{"rid": seq.rid, "running": seq.status == SequenceStatus.RUNNING,
             "token_ids": list(seq.token_ids), "num_prompt_tokens": seq.num_prompt_tokens}
            for seq in engine.requests.values() if not seq.is_finished]


def measured_ledger(engine: Engine, mode: str, new_path) -> dict:
    """Pause in ``mode``, update to ``new_path``, continue, finish everything: the engine's count."""
    engine.pause_generation(mode)
    engine.update_weights_from_disk(new_path, weight_version="new")
    engine.continue_generation()
    while engine.has_unfinished_requests():
        engine.step()
    record = engine.pause_stats[-1]
    return {key: getattr(record, key) for key in LEDGER_KEYS}


def greedy(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
