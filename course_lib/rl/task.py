"""The task the policy learns: answer in the byte class the prompt asks for.

A prompt is ``"upper:"`` or ``"lower:"`` (6 bytes each, so a batch needs no padding); the
reward of a completion is the fraction of its bytes in the class asked for (A-Z or
a-z). The reward is verifiable by a one-line check, dense enough for a tiny policy to
climb within a few dozen steps, and it depends on the prompt, so the policy has to read it.
A randomly initialised, near-uniform policy over 272 tokens scores about 26 / 272.
"""
from __future__ import annotations

import torch

from course_lib.config import ModelConfig
from course_lib.weights.checkpoint import random_state_dict, write_checkpoint

CLASSES = {"upper:": range(ord("A"), ord("Z") + 1), "lower:": range(ord("a"), ord("z") + 1)}
PROMPTS = list(CLASSES)

# Small enough that a training step takes milliseconds on a CPU core.
POLICY_CONFIG = ModelConfig(vocab_size=272, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            max_position_embeddings=64)


def reward(prompt: str, completion_ids: list[int]) -> float:
    """Fraction of the completion's tokens in the byte class ``prompt`` names (0 for an empty one)."""
    allowed = CLASSES[prompt]
    return sum(t in allowed for t in completion_ids) / len(completion_ids) if completion_ids else 0.0


def initial_checkpoint(path, seed: int = 0, config: ModelConfig = POLICY_CONFIG):
    """A random starting policy written as an HF checkpoint. The LM head is scaled down so
    that the first policy is close to uniform: every token gets explored."""
    tensors = random_state_dict(config, seed)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 0.05
    return write_checkpoint(path, config, tensors)


def encode(prompts: list[str]) -> torch.Tensor:
    """Prompts as a [B, P] tensor of byte ids (all prompts of a task have the same length)."""
    return torch.tensor([list(p.encode()) for p in prompts])
