"""The RL loop: generate with the engine, score, take a policy-gradient step, sync, repeat.

``train(engine, LoopConfig(...))`` runs it and returns a ``LoopResult``. The trainer is
REINFORCE with group-normalised advantages (GRPO's advantage, no critic): each prompt is
sampled ``group_size`` times, and a completion is pushed up or down by how much better
its reward is than its group's mean.

Two schedules:

- ``pause_mode=None`` (synchronous): a batch is generated entirely by one version, the
  trainer steps, the weights are synced while the engine is idle. Every token is on-policy.
- ``pause_mode`` in abort / wait / keep / retract (partial rollouts): the next batch starts
  generating *before* the sync; after ``overlap_tokens`` engine steps the engine pauses
  in that mode, the weights change, generation continues. Under keep and retract a
  rollout then holds tokens of two versions; the trainer, one version further along,
  weighs each token by ``correction`` (see ``corrections.py``).

Every token's version comes from the engine (``meta_info["weight_versions"]``), and the
result keeps every rollout with its versions, the engine's step log, the per-phase time
line and the pause records, so a test or a chapter can check the bookkeeping.
"""
from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass, field

import torch

from course_lib.rl import corrections, task
from course_lib.rl.policy import Policy, keep_logprobs


@dataclass
class LoopConfig:
    steps: int = 30                 # trainer steps (= weight syncs)
    group_size: int = 8             # samples per prompt
    prompts: tuple = tuple(task.PROMPTS)
    max_new_tokens: int = 8
    temperature: float = 1.0
    lr: float = 3e-2
    seed: int = 0
    pause_mode: str | None = None   # None: synchronous; else the partial-rollout pause mode
    overlap_tokens: int = 3         # partial rollouts: tokens per rollout generated before the sync
    correction: object = "importance"  # "importance", "drop", "none", or a callable (corrections.py)
    clip: float = 2.0               # importance weights are truncated at this value
    measure_keep_gap: bool = False  # keep: also compute what the engine really sampled from


@dataclass
class Rollout:
    rid: str
    prompt: str
    output_ids: list[int]
    versions: list[str]             # one per output token, from meta_info["weight_versions"]
    spans: list[dict]
    reward: float
    started_at: int                 # the trainer step during which it was submitted
    trained_at: int = -1            # the trainer step that used it
    weights: list[float] = field(default_factory=list)  # the correction's per-token weights


@dataclass
class LoopResult:
    rewards: list[float] = field(default_factory=list)       # mean reward of each step's batch
    rollouts: list[Rollout] = field(default_factory=list)
    timeline: list[tuple] = field(default_factory=list)      # (step, phase, start_s, end_s)
    syncs: list[dict] = field(default_factory=list)          # per sync: phases_ms, bytes, version
    aborted: list[dict] = field(default_factory=list)        # outputs thrown away by abort pauses
    keep_gap: list[float] = field(default_factory=list)      # keep: mean |log p served - log p recomputed|
    seconds: float = 0.0

    def phase_ms(self) -> list[dict]:
        """Per trainer step: milliseconds per phase."""
        steps: dict[int, dict] = {}
        for step, phase, a, b in self.timeline:
            steps.setdefault(step, {})
            steps[step][phase] = steps[step].get(phase, 0.0) + 1e3 * (b - a)
        return [steps[k] for k in sorted(steps)]


def version_label(step: int) -> str:
    return f"step-{step}"


def expand_spans(spans: list[dict]) -> list[str]:
    """Per-token versions from ``weight_versions`` spans."""
    return [s["version"] for s in spans for _ in range(s["start"], s["end"])]


@contextlib.contextmanager
def one_thread():
    """Run on one CPU thread. The matrices here are tiny: handing them to a thread pool
    costs more than the arithmetic, and far more on a machine shared with other jobs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Trainer:
    """The trainer's side: its policy, its optimizer, and copies of recent versions."""

    def __init__(self, policy: Policy, cfg: LoopConfig):
        self.policy, self.cfg = policy, cfg
        self.opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
        self.version = version_label(0)
        self.snapshots = {self.version: policy.checkpoint_tensors()}  # version -> weights
        self._scratch = Policy(policy.config)  # evaluates older versions

    def logprobs_of(self, version: str, prompts, completions) -> torch.Tensor:
        self._scratch.load_tensors(self.snapshots[version])
        with torch.no_grad():
            return self._scratch.token_logprobs(prompts, completions, self.cfg.temperature)

    def step(self, batch: list[Rollout], weigh) -> None:
        """One policy-gradient step on ``batch``; fills each rollout's ``weights``."""
        cfg = self.cfg
        prompts = task.encode([r.prompt for r in batch])
        completions = torch.tensor([r.output_ids for r in batch])
        rewards = torch.tensor([r.reward for r in batch])
        adv = torch.zeros_like(rewards)
        for p in set(r.prompt for r in batch):  # group-normalised advantage
            idx = [i for i, r in enumerate(batch) if r.prompt == p]
            g = rewards[idx]
            adv[idx] = (g - g.mean()) / (g.std(unbiased=False) + 1e-6)
        logp = self.policy.token_logprobs(prompts, completions, cfg.temperature)
        now = logp.detach()
        seen = {v for r in batch for v in r.versions} - {self.version}
        then = {v: self.logprobs_of(v, prompts, completions) for v in seen if v in self.snapshots}
        rows = []
        for i, r in enumerate(batch):
            by_version = {v: lp[i] for v, lp in then.items()}
            by_version[self.version] = now[i]
            w = torch.as_tensor(weigh(r.spans, self.version, now[i], by_version, cfg.clip), dtype=torch.float32)
            if w.shape != now[i].shape or not torch.isfinite(w).all():
                raise ValueError(f"the correction returned {w.tolist()} for versions {r.versions}: "
                                 f"expected {now.shape[1]} finite weights")
            r.weights = w.tolist()
            rows.append(w)
        weights = torch.stack(rows)
        loss = -(weights * adv[:, None] * logp).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        old, self.version = self.version, version_label(int(self.version.split("-")[1]) + 1)
        # Keep this version and the one before: a partial rollout never spans more than two.
        self.snapshots = {self.version: self.policy.checkpoint_tensors(), old: self.snapshots[old]}


class Rollouts:
    """The generation side over the engine's step API (or a server's /generate)."""

    def __init__(self, engine, cfg: LoopConfig, client=None):
        self.engine, self.cfg, self.client = engine, cfg, client
        self.rng = random.Random(cfg.seed)
        self.in_flight: dict[str, tuple[str, int]] = {}  # rid -> (prompt, started_at)
        self.done: list[dict] = []

    def params(self) -> dict:
        return {"max_new_tokens": self.cfg.max_new_tokens, "temperature": self.cfg.temperature,
                "seed": self.rng.randrange(2 ** 31), "ignore_eos": True}

    def prompts(self) -> list[str]:
        return [p for p in self.cfg.prompts for _ in range(self.cfg.group_size)]

    def submit(self, prompts: list[str], step: int) -> None:
        for p in prompts:
            rid = self.engine.add_request(p, self.params())
            self.in_flight[rid] = (p, step)

    def run_steps(self, n: int | None = None) -> None:
        """``n`` engine steps (None: until every submitted request finished)."""
        k = 0
        while self.in_flight and (n is None or k < n):
            self.done += self.engine.step()
            k += 1
            if n is None and not self.engine.has_unfinished_requests():
                break

    def collect(self, result: LoopResult, step: int) -> list[Rollout]:
        """Finished outputs as rollouts; aborted ones are recorded and submitted again."""
        while True:
            self.run_steps()
            again = []
            for out in self.done:
                prompt, started = self.in_flight.pop(out["rid"])
                if out["meta_info"]["finish_reason"]["type"] == "abort":
                    result.aborted.append(out)
                    again.append(prompt)
                else:
                    result.rollouts.append(make_rollout(out, prompt, started))
            self.done = []
            if not again:
                break
            self.submit(again, step)
        batch = [r for r in result.rollouts if r.trained_at < 0]
        return batch

    def generate_over_http(self, result: LoopResult, step: int) -> list[Rollout]:
        prompts = self.prompts()
        outs = self.client.generate(text=prompts, sampling_params=[self.params() for _ in prompts])
        batch = [make_rollout(o, p, step) for o, p in zip(outs, prompts)]
        result.rollouts += batch
        return batch


def make_rollout(out: dict, prompt: str, started: int) -> Rollout:
    spans = out["meta_info"]["weight_versions"]
    return Rollout(rid=out["meta_info"]["id"], prompt=prompt, output_ids=list(out["output_ids"]),
                   versions=expand_spans(spans), spans=spans, reward=task.reward(prompt, out["output_ids"]),
                   started_at=started)


def train(engine, cfg: LoopConfig, policy: Policy | None = None, sync=None, server=None) -> LoopResult:
    """Run the loop. ``engine`` serves the policy (it is also the target of the default
    in-process sync); ``policy`` is the trainer's copy (default: loaded from the engine's
    checkpoint); ``sync`` an object from ``sync.py``; with ``server`` (a running
    ``BackgroundServer`` of ``engine``) generation and sync go over HTTP.

    It reads top to bottom in the order chapter 08's timeline draws a step (generate,
    reward, train, sync); only where a batch comes from is told apart (``first_batch``,
    ``next_batch``)."""
    from course_lib.rl.sync import HttpSync, InProcessSync

    if cfg.pause_mode is not None and server is not None:
        raise ValueError("partial rollouts need the engine's step API; over HTTP use pause_mode=None")
    weigh = corrections.get(cfg.correction)
    torch.manual_seed(cfg.seed)
    with one_thread():
        policy = policy or Policy.from_checkpoint(engine.model_path)
        trainer = Trainer(policy, cfg)
        sync = sync or (HttpSync(server) if server is not None else InProcessSync(engine))
        client = sync.client if server is not None else None
        gen = Rollouts(engine, cfg, client)
        result, t0 = LoopResult(), time.perf_counter()

        def phase(step, name, since):
            now = time.perf_counter()
            result.timeline.append((step, name, since - t0, now - t0))
            return now

        # Version 0 is what the engine serves now; label it so every token names its step.
        (client or engine).update_weight_version(trainer.version)
        t = time.perf_counter()
        batch = first_batch(gen, result, client)
        t = phase(0, "generate", t)
        for step in range(cfg.steps):
            last = step == cfg.steps - 1
            if cfg.pause_mode is not None and not last:  # the next batch starts before the sync
                gen.submit(gen.prompts(), step + 1)
                gen.run_steps(cfg.overlap_tokens)
                t = phase(step, "generate (overlapped)", t)
            result.rewards.append(sum(r.reward for r in batch) / len(batch))
            t = phase(step, "reward", t)
            if cfg.measure_keep_gap and cfg.pause_mode == "keep":
                result.keep_gap.append(measure_keep_gap(trainer, batch, cfg.temperature))
            for r in batch:
                r.trained_at = step
            old_version = trainer.version
            trainer.step(batch, weigh)
            t = phase(step, "train", t)
            s = sync.sync(policy.named_tensors(), trainer.version, cfg.pause_mode if not last else None)
            s.update(step=step, version=trainer.version, replaced=old_version)
            record_sync(result, s, step, t - t0)
            t = time.perf_counter()
            if last:
                break
            batch = next_batch(gen, result, client, cfg, step + 1)
            t = phase(step + 1, "generate" if cfg.pause_mode is None else "generate (after sync)", t)
        result.seconds = time.perf_counter() - t0
        if server is not None:
            sync.close()
    return result


def record_sync(result: LoopResult, s: dict, step: int, start: float) -> None:
    """A step's sync and its phases on the timeline, laid end to end from ``start`` (s)."""
    result.syncs.append(s)
    for name, ms in s["phases_ms"].items():  # the engine's own phases
        result.timeline.append((step, f"sync: {name}", start, start + ms / 1e3))
        start += ms / 1e3


def first_batch(gen: "Rollouts", result: LoopResult, client) -> list:
    """Step 0's rollouts: over HTTP (``client``), or submitted to the engine and collected."""
    if client is not None:
        return gen.generate_over_http(result, 0)
    gen.submit(gen.prompts(), 0)
    return gen.collect(result, 0)


def next_batch(gen: "Rollouts", result: LoopResult, client, cfg: LoopConfig, step: int) -> list:
    """Step ``step``'s rollouts: over HTTP, submitted now (no partial rollouts), or the ones
    submitted before the sync (partial rollouts), collected."""
    if client is not None:
        return gen.generate_over_http(result, step)
    if cfg.pause_mode is None:
        gen.submit(gen.prompts(), step)
    return gen.collect(result, step)


def measure_keep_gap(trainer: Trainer, batch: list[Rollout], temperature: float) -> float:
    """Mean |log p| difference, over the new-version tokens of mixed rollouts, between what
    a keep pause really sampled from (new weights over old KV) and what the trainer
    recomputes with the new weights alone (and calls exactly 1 in its importance weight)."""
    mixed = [r for r in batch if len(r.spans) == 2]
    gaps = []
    for switch in sorted({r.spans[0]["end"] for r in mixed}):
        group = [r for r in mixed if r.spans[0]["end"] == switch]
        old_v, new_v = group[0].spans[0]["version"], group[0].spans[1]["version"]
        if old_v not in trainer.snapshots or new_v != trainer.version:
            continue
        prompts = task.encode([r.prompt for r in group])
        completions = torch.tensor([r.output_ids for r in group])
        old = Policy(trainer.policy.config)
        old.load_tensors(trainer.snapshots[old_v])
        served = keep_logprobs(old, trainer.policy, prompts, completions, switch, temperature)
        with torch.no_grad():
            recomputed = trainer.policy.token_logprobs(prompts, completions, temperature)
        gaps.append((served - recomputed)[:, switch:].abs().flatten())
    return torch.cat(gaps).mean().item() if gaps else 0.0
