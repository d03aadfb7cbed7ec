"""Turn the last position's logits into next tokens: greedy, or seeded temperature/top-p.

Each sequence samples with its own generator, so a seeded request draws the same tokens
whatever else shares its batch. A sequence that asked for logprobs also gets the chosen
token's logprob: ``log_softmax(logits / temperature)`` (temperature 1 when greedy), the
distribution the token was drawn from before top-p truncation, which is what an RL
trainer compares with its own policy at the same temperature.
"""
from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """One token from a [vocab] row of logits."""
    if temperature <= 1e-5:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = torch.cumsum(sorted_probs, -1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_batch(logits: torch.Tensor, seqs) -> list[int]:
    """Next token for each sequence; its sampling params and generator come from the sequence."""
    greedy = all(s.params.temperature <= 1e-5 for s in seqs)
    if greedy:
        tokens = logits.argmax(dim=-1).tolist()
    else:
        rows = logits.float().cpu()
        tokens = [sample(rows[i], s.params.temperature, s.params.top_p, s.generator) for i, s in enumerate(seqs)]
    record_logprobs(logits, seqs, tokens)
    return tokens


def record_logprobs(logits: torch.Tensor, seqs, tokens: list[int]) -> None:
    """Leave each chosen token's logprob on the sequences that asked for one."""
    want = [i for i, s in enumerate(seqs) if getattr(s, "return_logprob", False)]
    if not want:
        return
    temps = torch.tensor([seqs[i].params.temperature if seqs[i].params.temperature > 1e-5 else 1.0 for i in want])
    rows = logits[want].float().cpu() / temps[:, None]
    chosen = torch.log_softmax(rows, dim=-1)[torch.arange(len(want)), torch.tensor([tokens[i] for i in want])]
    for i, value in zip(want, chosen.tolist()):
        seqs[i].next_logprob = value
