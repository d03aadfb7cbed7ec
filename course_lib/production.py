"""Changing versions in production: canary comparison, promote-or-rollback, monitoring.

- ``canary_compare(old, new, prompts, reference=None)``: greedy outputs of a fixed request
  set from two targets (an ``Engine``, an ``EngineClient`` of a running server, or stored
  token lists), compared token by token: where each request first diverges, and the share
  of requests that agree exactly.
- ``promote_or_rollback(engine, new_path, prompts, reference)``: update from disk keeping a
  host-memory snapshot of the old weights, check the canary (and optionally a quality
  metric), and roll back from the snapshot (no disk read) when a check fails.

The comparison (``first_divergence``, ``compare_outputs``) and the policy
(``promote_or_rollback``) are chapter 09's exercises; nothing before chapter 09 runs them.
- ``Monitor``: per-request latency, per-batch throughput and output length, by weight
  version, across version changes; ``anomalies`` compares two versions, ``plot`` draws it.

Everything here uses only the engine's and the client's public methods.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from course_lib.weights.commit.validate import UpdateError

GREEDY = {"temperature": 0, "ignore_eos": True}


# ---- outputs and their comparison ---------------------------------------------------------
def greedy_outputs(target, prompts, max_new_tokens: int = 16, ignore_eos: bool = True) -> list[list[int]]:
    """Greedy completions (token ids) of ``prompts`` (strings or token-id lists) from an
    ``Engine``, an ``EngineClient``, or a list of stored token lists (returned as given)."""
    prompts = list(prompts)
    if isinstance(target, (list, tuple)):
        if len(target) != len(prompts):
            raise ValueError(f"{len(target)} stored outputs for {len(prompts)} prompts")
        return [list(t) for t in target]
    return [o["output_ids"] for o in run_requests(target, prompts, dict(GREEDY, max_new_tokens=max_new_tokens,
                                                                        ignore_eos=ignore_eos))]


def run_requests(target, prompts, sampling_params, retry_paused_s: float = 30.0) -> list[dict]:
    """Outputs (``text``, ``output_ids``, ``meta_info``) of ``prompts`` from an Engine or an EngineClient."""
    by_ids = bool(prompts) and not isinstance(prompts[0], str)
    if hasattr(target, "add_request"):  # an Engine, called in this thread
        if by_ids:
            return target.generate(input_ids=[list(p) for p in prompts], sampling_params=sampling_params)
        return target.generate(list(prompts), sampling_params)
    key = {"input_ids": [list(p) for p in prompts]} if by_ids else {"text": list(prompts)}
    # A server paused for an update answers 503 "paused"; a client waits it out.
    return target.generate(**key, sampling_params=sampling_params, retry_paused_s=retry_paused_s)


def first_divergence(expected: list[int], got: list[int]) -> int | None:
    """The first position where ``got`` differs from ``expected``, or None when the two
    lists are equal (two empty lists included: an empty answer where an empty answer was
    expected agrees).

    - a token differs at position ``k`` (and none before it): ``k``;
    - one list is a strict prefix of the other (an answer cut short, or one that ran
      on): they diverge where the shorter one ends, ``min(len(expected), len(got))``;
      so an empty answer where tokens were expected diverges at 0.

    Returns a plain ``int`` or None; reads the lists and never changes them.
    """
    # BEGIN EXERCISE ch09.first_divergence
    shared = min(len(expected), len(got))
    for position in range(shared):
        if expected[position] != got[position]:
            return position
    # Equal over the part both have: only the lengths can still differ.
    return None if len(expected) == len(got) else shared
    # END EXERCISE


def compare_outputs(expected: list[list[int]], got: list[list[int]]) -> dict:
    """Token-by-token comparison of two output sets for the same requests, in the same
    order (``expected[i]``: the answer request ``i`` should get; ``got[i]``: the answer it
    got; each a list of token ids, possibly empty). Returns a dict:

    - ``"first_divergence"``: one entry per request, where its two answers part, exactly
      as exercise 1 of this chapter defines it (None: identical; an answer cut short or run
      long diverges where the shorter ends);
    - ``"agreement"``: the share of requests whose answers are identical (a float in
      [0, 1]; matching tokens after a divergence do not count, nor do equal lengths);
    - ``"matched_fraction"``: the mean over requests of the share of ``expected[i]``
      reproduced before the first divergence (1.0 for an identical answer, the empty one
      included; 0.0 for a request that diverges at 0).

    Raises ``ValueError`` naming both counts when the two lists have different lengths
    (never compare only the common part), and ``ValueError`` for an empty request set (an
    agreement of nothing is not 1.0). Reads its inputs and never changes them.
    """
    # BEGIN EXERCISE ch09.compare_outputs
    if len(expected) != len(got):
        raise ValueError(f"{len(expected)} expected outputs but {len(got)} outputs to check")
    if not expected:
        raise ValueError("nothing to compare: the request set is empty")
    firsts = [first_divergence(e, g) for e, g in zip(expected, got)]
    # An identical answer reproduced all of the expected one, however long (or empty) it is.
    matched = [1.0 if f is None else f / len(e) if e else 0.0 for f, e in zip(firsts, expected)]
    return {"first_divergence": firsts, "agreement": sum(f is None for f in firsts) / len(firsts),
            "matched_fraction": sum(matched) / len(matched)}
    # END EXERCISE


@dataclass
class CanaryReport:
    """What ``canary_compare`` found. ``vs_old`` compares the new target with the old one;
    ``vs_reference`` (when a reference was given) compares it with the expected outputs."""
    prompts: list
    old: list[list[int]]
    new: list[list[int]]
    vs_old: dict
    reference: list[list[int]] | None = None
    vs_reference: dict | None = None

    def lines(self) -> list[str]:
        """One readable line per request."""
        out = []
        for i, p in enumerate(self.prompts):
            where = self.vs_old["first_divergence"][i]
            line = f"request {i}: " + ("same as old" if where is None else f"differs from old at token {where}")
            if self.vs_reference is not None:
                ref = self.vs_reference["first_divergence"][i]
                line += ", " + ("same as reference" if ref is None else f"differs from reference at token {ref}")
            out.append(line)
        return out


def canary_compare(old, new, prompts, reference=None, max_new_tokens: int = 16, compare=compare_outputs
                   ) -> CanaryReport:
    """Greedy outputs of ``prompts`` from ``old`` and ``new`` (each an Engine, an
    EngineClient or stored token lists), and optionally ``reference`` (the outputs the new
    version should give, e.g. recorded where it was trained or cold-started), compared
    token by token with ``compare(expected, got)`` (a dict with at least ``agreement``)."""
    prompts = list(prompts)
    old_out = greedy_outputs(old, prompts, max_new_tokens)
    new_out = greedy_outputs(new, prompts, max_new_tokens)
    report = CanaryReport(prompts, old_out, new_out, compare(old_out, new_out))
    if reference is not None:
        report.reference = greedy_outputs(reference, prompts, max_new_tokens)
        report.vs_reference = compare(report.reference, new_out)
    return report


def mean_nll(engine, sequences: list[list[int]]) -> float:
    """Mean negative log-likelihood per predicted token of ``sequences`` (token-id lists of
    at least two tokens) under ``engine``'s current weights: a quality score on an
    evaluation set (lower is better). Teacher-forced, so one early divergence does not
    decide the whole score the way it decides a greedy comparison."""
    from course_lib.testing import prompt_logits

    total, count = 0.0, 0
    for ids in sequences:
        if len(ids) < 2:
            raise ValueError("each evaluation sequence needs at least two tokens")
        logits = prompt_logits(engine, ids)[:-1]
        target = torch.tensor(ids[1:])
        total += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        count += len(ids) - 1
    return total / count


# ---- the policy ---------------------------------------------------------------------------
# Its docstring is the whole specification you write chapter 09's rollback part from.
def promote_or_rollback(engine, new_path, prompts, reference, weight_version: str | None = None,
                        min_agreement: float = 1.0, quality=None, min_quality: float | None = None,
                        max_new_tokens: int = 16, compare=compare_outputs, pause_mode: str = "retract",
                        partial: bool = False) -> dict:
    """Move ``engine`` to the checkpoint at ``new_path`` and keep it only if it passes.

    Promises, in the order they happen:

    0. ``min_quality`` without ``quality``: ``ValueError`` before anything changes. The
       expected outputs are ``reference``'s greedy answers to ``prompts`` (stored token
       lists, or an Engine / EngineClient serving the intended version; never the engine
       under test), taken first.
    1. The engine, paused in ``pause_mode``, is updated from ``new_path`` (labelled
       ``weight_version``, ``partial`` as given) keeping a host snapshot of the serving
       weights, the prefix cache flushed. A refused update (``UpdateError``: the engine put
       back any layer it wrote) is decision ``"rejected"``, reason ``"update refused:
       <error>"``, the old weights serving. Whatever happens, the engine is not left paused.
    2. The canary: the serving engine's greedy answers compared with the expected ones
       (``compare``); an agreement below ``min_agreement`` is a reason to roll back, and so
       is ``quality(engine)`` (higher is better) below ``min_quality`` when given.
    3. Any reason: the snapshot is copied back in place (bitwise the old weights and
       label, no disk read, no address moves), serving again: ``"rolled_back"``. None:
       ``"promoted"`` (the new version serves; the snapshot is kept for a later rollback).
       An error of ``compare``, ``quality`` or the canary's generation is no decision: it
       reaches the caller, the new version serving, its snapshot kept (see ``rollback_now``).

    Returns ``decision``, ``reasons`` (strings, empty when promoted), ``agreement`` (float, None if
    rejected), ``quality`` (float or None), ``comparison``, ``update`` and ``rollback`` (each or None).
    """
    # BEGIN EXERCISE ch09.rollback
    if min_quality is not None and quality is None:
        raise ValueError("min_quality needs a quality function")
    expected = greedy_outputs(reference, prompts, max_new_tokens)  # before anything changes
    result = {"decision": None, "reasons": [], "agreement": None, "quality": None, "update": None,
              "rollback": None, "comparison": None}
    engine.pause_generation(pause_mode)
    try:
        result["update"] = engine.update_weights_from_disk(new_path, weight_version=weight_version,
                                                           keep_snapshot=True, partial=partial)
    except UpdateError as exc:  # validated before any write, or put back: the old weights serve
        result.update(decision="rejected", reasons=[f"update refused: {exc}"])
        return result
    finally:  # a paused engine serves nobody: continue on every way out, errors included
        engine.continue_generation()

    got = greedy_outputs(engine, prompts, max_new_tokens)
    comparison = compare(expected, got)
    result["comparison"] = comparison
    result["agreement"] = float(comparison["agreement"])
    if result["agreement"] < min_agreement:
        result["reasons"].append(f"agreement {result['agreement']:.2f} is below {min_agreement:.2f}")
    if quality is not None:
        result["quality"] = float(quality(engine))
        if min_quality is not None and result["quality"] < min_quality:  # without one, only recorded
            result["reasons"].append(f"quality {result['quality']:.4f} is below {min_quality:.4f}")
    if result["reasons"]:
        result["rollback"] = rollback_now(engine, pause_mode)  # from host memory: no disk read
    result["decision"] = "rolled_back" if result["reasons"] else "promoted"
    return result
    # END EXERCISE


def rollback_now(engine, pause_mode: str = "retract") -> dict:
    """Pause, restore the snapshot the last ``keep_snapshot=True`` update kept, continue."""
    engine.pause_generation(pause_mode)
    try:
        return engine.rollback()
    finally:
        engine.continue_generation()


# ---- monitoring ---------------------------------------------------------------------------
@dataclass
class Monitor:
    """A small time series of serving metrics, by weight version.

    ``run(target, prompts, params)`` times one batch and records it; ``record(outputs,
    wall_s)`` records a batch timed elsewhere. Per request: end-to-end latency (from
    ``meta_info["e2e_latency"]``), output length and version; per batch: tokens per second.
    ``mark(label)`` notes an event (an update, a rollback) for the plot.
    """
    requests: list[dict] = field(default_factory=list)
    batches: list[dict] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def mark(self, label: str) -> None:
        self.events.append((self.now(), label))

    def run(self, target, prompts, sampling_params) -> list[dict]:
        start = time.perf_counter()
        outputs = run_requests(target, list(prompts), sampling_params)
        self.record(outputs, time.perf_counter() - start)
        return outputs

    def record(self, outputs: list[dict], wall_s: float) -> None:
        t = self.now()
        versions = []
        for out in outputs:
            meta = out["meta_info"]
            versions.append(meta["weight_version"])
            self.requests.append({"t": t, "version": meta["weight_version"], "latency_s": meta["e2e_latency"],
                                  "length": meta["completion_tokens"],
                                  "aborted": meta["finish_reason"]["type"] == "abort"})
        tokens = sum(o["meta_info"]["completion_tokens"] for o in outputs)
        self.batches.append({"t": t, "version": max(set(versions), key=versions.count) if versions else None,
                             "requests": len(outputs), "tokens": tokens, "wall_s": wall_s,
                             "tokens_per_s": tokens / wall_s if wall_s > 0 else float("nan"),
                             "mean_length": tokens / len(outputs) if outputs else 0.0})

    def by_version(self) -> dict[str, dict]:
        """Per version: requests, median and 95th-percentile latency (ms), mean output
        length, and throughput (tokens per second over its batches)."""
        out = {}
        for v in dict.fromkeys(r["version"] for r in self.requests):
            reqs = [r for r in self.requests if r["version"] == v]
            lat = sorted(1e3 * r["latency_s"] for r in reqs)
            batches = [b for b in self.batches if b["version"] == v]
            wall = sum(b["wall_s"] for b in batches)
            out[v] = {"requests": len(reqs), "latency_p50_ms": statistics.median(lat),
                      "latency_p95_ms": lat[min(len(lat) - 1, int(0.95 * len(lat)))],
                      "mean_length": statistics.fmean(r["length"] for r in reqs),
                      "tokens_per_s": sum(b["tokens"] for b in batches) / wall if wall > 0 else float("nan")}
        return out

    def anomalies(self, baseline: str, candidate: str, max_latency_ratio: float = 2.0,
                  min_throughput_ratio: float = 0.5, max_length_change: float = 0.25) -> list[str]:
        """Reasons to roll ``candidate`` back, judged against ``baseline``: median latency
        more than ``max_latency_ratio`` times, throughput below ``min_throughput_ratio``
        times, or mean output length changed by more than ``max_length_change`` (a share)."""
        stats = self.by_version()
        for v in (baseline, candidate):
            if v not in stats:
                raise KeyError(f"no requests recorded for version {v!r}; recorded: {sorted(stats)}")
        b, c = stats[baseline], stats[candidate]
        reasons = []
        if c["latency_p50_ms"] > max_latency_ratio * b["latency_p50_ms"]:
            reasons.append(f"median latency {c['latency_p50_ms']:.1f} ms vs {b['latency_p50_ms']:.1f} ms")
        if c["tokens_per_s"] < min_throughput_ratio * b["tokens_per_s"]:
            reasons.append(f"throughput {c['tokens_per_s']:.0f} vs {b['tokens_per_s']:.0f} tokens/s")
        if abs(c["mean_length"] - b["mean_length"]) > max_length_change * b["mean_length"]:
            reasons.append(f"mean output length {c['mean_length']:.1f} vs {b['mean_length']:.1f} tokens")
        return reasons

    def plot(self, title: str = "Serving metrics across version changes"):
        """Three panels over time (latency, throughput, output length), coloured by version,
        with the marked events as vertical lines. Returns the matplotlib figure."""
        import matplotlib.pyplot as plt

        versions = list(dict.fromkeys(r["version"] for r in self.requests))
        colour = {v: f"C{i % 10}" for i, v in enumerate(versions)}
        fig, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
        for v in versions:
            reqs = [r for r in self.requests if r["version"] == v]
            batches = [b for b in self.batches if b["version"] == v]
            axes[0].scatter([r["t"] for r in reqs], [1e3 * r["latency_s"] for r in reqs], s=10,
                            color=colour[v], label=v)
            axes[1].plot([b["t"] for b in batches], [b["tokens_per_s"] for b in batches], "o", color=colour[v])
            axes[2].plot([b["t"] for b in batches], [b["mean_length"] for b in batches], "o", color=colour[v])
        for ax, label in zip(axes, ["latency (ms)", "tokens / s", "mean output length"]):
            ax.set_ylabel(label)
            ax.set_ylim(bottom=0)
            for t, text in self.events:
                ax.axvline(t, color="gray", ls="--", lw=1)
        for t, text in self.events:
            axes[0].annotate(text, (t, 1), xycoords=("data", "axes fraction"), rotation=90, va="top",
                             ha="right", fontsize=8, color="gray")
        axes[0].legend(title="weight version", loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        axes[0].set_title(title)
        axes[2].set_xlabel("seconds since the monitor started")
        fig.tight_layout()
        return fig
