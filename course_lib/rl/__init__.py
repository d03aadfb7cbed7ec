"""A tiny RL trainer that syncs its policy into the engine after every step.

- ``task.py``: the verifiable task (answer in the byte class the prompt names) and its reward;
- ``policy.py``: the trainer's differentiable copy of the Qwen3 policy, HF tensor names;
- ``corrections.py``: per-token weights for tokens an older policy sampled;
- ``sync.py``: in-process, IPC-bucket and HTTP weight syncs, timed per phase;
- ``loop.py``: ``train(engine, LoopConfig(...))``: synchronous or partial-rollout loops.
"""
from course_lib.rl.loop import LoopConfig, LoopResult, Rollout, train  # noqa: F401
from course_lib.rl.policy import Policy, keep_logits, keep_logprobs  # noqa: F401
