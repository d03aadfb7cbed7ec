"""Wrong answer: a block is reused when the same tokens were cached at that position, whatever came before it (no prefix chain)."""
from __future__ import annotations

MODES = {"abort": "abort", "wait": "wait", "keep": "keep", "in_place": "keep", "retract": "retract"}


def generated(request: dict) -> int:
    return len(request["token_ids"]) - request["num_prompt_tokens"]


def reprefill_tokens(retracted: list[dict], block_size: int) -> int:
    """Tokens the re-prefills compute, in order, each reusing whole blocks that an earlier
    one of them put in the (freshly salted) cache."""
    filled = set()  # whole-block prefixes computed by the re-prefills so far
    total = 0
    for request in retracted:
        ids = request["token_ids"]
        reused = 0
        # The block holding the last token is always computed: its logits choose the next token.
        while reused < (len(ids) - 1) // block_size and tuple(ids[reused * block_size:(reused + 1) * block_size]) in filled:
            reused += 1
        total += len(ids) - reused * block_size
        filled.update(tuple(ids[b * block_size:(b + 1) * block_size]) for b in range(len(ids) // block_size))
    return total


def pause_ledger(mode: str, requests: list[dict], block_size: int) -> dict:
    """What engine.pause_stats[-1] will say after pause(mode) -> update -> continue -> drain."""
    if mode not in MODES:
        raise ValueError(f"unknown pause mode {mode!r}; expected one of {sorted(MODES)}")
    mode = MODES[mode]
    ledger = {"aborted_requests": 0, "discarded_tokens": 0, "retracted_requests": 0, "reprefill_tokens": 0,
              "mixed_requests": 0, "kv_fresh": True}
    running = [r for r in requests if r["running"]]
    if mode == "abort":  # queued requests are aborted too
        ledger["aborted_requests"] = len(requests)
        ledger["discarded_tokens"] = sum(generated(r) for r in requests)
    elif mode == "keep":  # a preempted request in the queue has old tokens as well
        ledger["mixed_requests"] = sum(1 for r in requests if generated(r) > 0)
        ledger["kv_fresh"] = not running
    elif mode == "retract":
        ledger["retracted_requests"] = len(running)
        ledger["reprefill_tokens"] = reprefill_tokens(running, block_size)
        ledger["mixed_requests"] = sum(1 for r in requests if generated(r) > 0)
    return ledger
