"""The front door: ``python -m course_lib demo`` shows a hot weight update on one screen.

Two tiny checkpoints are made from seeds (v1, v2; nothing is downloaded). An engine starts
on v1 and generates for a few requests; mid-generation it pauses (one of the four pause
modes), takes v2 from disk in place, and continues. Then it prints what the engine itself
recorded: each request's per-token weight versions, the update's phase timings and bytes,
the pause's costs, and whether the updated engine equals one cold-started on v2.

Only the engine's public API is used, so the demo reads as a user's script would.
"""
from __future__ import annotations

import sys
import tempfile
import time

from course_lib.weights.checkpoint import PRESETS, make_random

MODES = ("retract", "keep", "abort", "wait")

# What each mode does with the requests in flight (shown for the chosen one, the others listed).
MODE_STORY = {
    "retract": "in-flight requests go back to the queue, their KV freed;\n"
               "   on continue they are re-prefilled (prompt + tokens so far) on the new weights",
    "keep": "in-flight requests freeze, KV kept;\n"
            "   on continue they go on with the new weights over KV the old weights computed",
    "abort": "in-flight requests end now (finish_reason abort);\n"
             "   their tokens are thrown away and the client must resubmit",
    "wait": "in-flight requests run to their end on the old weights;\n"
            "   the update waits for them (no mixing, but the update is late)",
}

# (prompt, max_new_tokens): the first ends before the update, the next two are in flight
# when it lands, the last arrives after it. Distinct first bytes: no shared prefix blocks.
REQUESTS = [("Hot updates keep the process", 4), ("Weights change between two steps", 12),
            ("Versions are recorded per token", 12)]
LATE_REQUEST = ("New requests see the new weights", 6)
STEPS_BEFORE_PAUSE = 6
GREEDY = {"temperature": 0, "ignore_eos": True}
# The update's phases in the order a reader follows them (layer by layer, transfer,
# post-process and copy interleave; each is the total over all layers).
PHASE_ORDER = ("validate", "snapshot", "wait", "transfer", "post_process", "copy", "audit", "flush")


def check_options(mode: str, device: str, preset: str) -> str | None:
    """What is wrong with these options, or None."""
    import torch

    if mode not in MODES:
        return f"unknown mode {mode!r}; choose from {', '.join(MODES)}"
    if preset not in PRESETS:
        return f"unknown preset {preset!r}; choose from {', '.join(sorted(PRESETS))}"
    if device not in ("cpu", "cuda"):
        return f"unknown device {device!r}; choose cpu or cuda"
    if device == "cuda" and not torch.cuda.is_available():
        return "device cuda, but torch sees no GPU; use --device cpu"
    return None


def run(mode: str = "retract", device: str = "cpu", seed: int = 0, preset: str = "tiny",
        echo=lambda line: None) -> dict:
    """Run the demo, calling ``echo(line)`` as it goes; return what it measured:
    ``outputs`` (engine outputs, in request order, each with its ``prompt``), ``update``
    (what ``update_weights_from_disk`` returned), ``pause`` (the engine's cost record),
    ``hot_equals_cold`` (None when equal, else why not) and ``checkpoints``."""
    problem = check_options(mode, device, preset)
    if problem:
        raise ValueError(problem)
    with tempfile.TemporaryDirectory(prefix="course_lib-demo-") as tmp:
        t0 = time.perf_counter()
        v1 = make_random(f"{tmp}/v1", preset, seed=seed)
        v2 = make_random(f"{tmp}/v2", preset, seed=seed + 1)
        cfg = PRESETS[preset]
        echo(f"1. two '{preset}' checkpoints from seeds, v1 ({seed}) and v2 ({seed + 1}): "
             f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, made in {time.perf_counter() - t0:.2f} s")
        result = _generate_across_update(v1, v2, mode, device, echo)
        engine = result.pop("engine")
        echo("")
        _show_spans(result["outputs"], echo)
        result["pause"] = engine.pause_stats[-1].as_dict()
        _show_costs(result["update"], result["pause"], echo)
        result["hot_equals_cold"] = check_hot_equals_cold(engine, v2, echo)
        result["checkpoints"] = {"v1": str(v1), "v2": str(v2)}
    return result


def _generate_across_update(v1, v2, mode: str, device: str, echo) -> dict:
    """Start on v1, generate, pause in ``mode``, update to v2, continue, finish."""
    from course_lib import Engine

    engine = Engine(v1, device=device)
    engine.update_weight_version("v1")
    prompts = {}
    for prompt, n in REQUESTS:
        prompts[engine.add_request(prompt, dict(GREEDY, max_new_tokens=n))] = prompt
    done: dict[str, dict] = {}
    for _ in range(STEPS_BEFORE_PAUSE):
        done.update((o["rid"], o) for o in engine.step())
    in_flight = len(prompts) - len(done)
    echo(f"2. engine on {device}, started in {engine.timings['startup_s']:.2f} s; {len(prompts)} requests "
         f"queued, {STEPS_BEFORE_PAUSE} steps run: {len(done)} finished, {in_flight} still generating")
    engine.pause_generation(mode)
    for line in f"3. pause_generation({mode!r}): {MODE_STORY[mode]}".splitlines():
        echo(line)
    try:
        engine.add_request("too early", dict(GREEDY, max_new_tokens=1))
    except RuntimeError as exc:  # refused while paused: the client retries after continue
        echo(f"   a new request now is refused ({type(exc).__name__}): retry after continue_generation()")
    update = engine.update_weights_from_disk(v2, weight_version="v2")
    echo(f"   update_weights_from_disk(v2): {update['bytes'] / 1e6:.2f} MB validated and copied in "
         f"place in {update['elapsed_ms']:.1f} ms; now serving {engine.get_weight_version()}")
    engine.continue_generation()
    late, n = LATE_REQUEST
    prompts[engine.add_request(late, dict(GREEDY, max_new_tokens=n))] = late
    echo("   continue_generation(); one more request arrives; every request runs to its end")
    while engine.has_unfinished_requests():
        done.update((o["rid"], o) for o in engine.step())
    outputs = [dict(done[rid], prompt=prompt) for rid, prompt in prompts.items()]
    return {"engine": engine, "outputs": outputs, "update": update}


def version_bar(spans: list[dict]) -> str:
    """``v1 v1 v1 | v2 v2``: one version per output token, a bar where the version changes."""
    return " | ".join(" ".join([s["version"]] * (s["end"] - s["start"])) for s in spans)


def _show_spans(outputs: list[dict], echo) -> None:
    echo('4. per-token weight versions of each request (meta_info["weight_versions"]):')
    width = max(len(o["prompt"]) for o in outputs) + 2
    for o in outputs:
        spans = o["meta_info"]["weight_versions"]
        reason = o["meta_info"]["finish_reason"]["type"]
        bar = version_bar(spans) or "(no tokens)"
        echo(f"   {repr(o['prompt']):<{width}} {bar}" + (f"  [{reason}]" if reason != "length" else ""))
    spans = [f"{s['version']}:{s['start']}-{s['end']}" for s in outputs[1]["meta_info"]["weight_versions"]]
    echo(f"   (as spans: {outputs[1]['prompt']!r} -> {', '.join(spans)}; end exclusive)")


def _show_costs(update: dict, pause: dict, echo) -> None:
    ms = update["timings_ms"]
    order = [k for k in PHASE_ORDER if k in ms] + [k for k in ms if k not in PHASE_ORDER]
    memory = update.get("memory", {})
    echo(f"5. the update: {update['bytes']:,} bytes in {update['elapsed_ms']:.1f} ms"
         + (f", peak extra memory {memory['peak_held_bytes']:,} bytes (one layer at a time)"
            if "peak_held_bytes" in memory else ""))
    echo("   timings_ms: " + " | ".join(f"{k} {ms[k]:.2f}" for k in order))
    echo(f"   the pause ({pause['mode']}), as the engine counted it (engine.pause_stats):")
    echo(f"     aborted {pause['aborted_requests']} ({pause['discarded_tokens']} tokens thrown away) | "
         f"retracted {pause['retracted_requests']} ({pause['reprefill_tokens']} tokens re-prefilled) | "
         f"waited {pause['wait_s'] * 1e3:.1f} ms")
    echo(f"     requests mixing v1 and v2: {pause['mixed_requests']} | live KV all from v2: "
         f"{'yes' if pause['kv_fresh'] else 'no'} | resume {pause['resume_ms']:.2f} ms")


def check_hot_equals_cold(engine, checkpoint, echo) -> str | None:
    """None when ``engine`` equals one cold-started on ``checkpoint``, else the difference found."""
    from course_lib.testing import assert_hot_equals_cold

    prompts = [p for p, _ in REQUESTS]
    try:
        assert_hot_equals_cold(engine, checkpoint, prompts, max_new_tokens=8)
    except AssertionError as exc:
        echo(f"6. hot != cold: {exc}")
        return str(exc)
    echo(f"6. hot == cold: after the update, {len(prompts)} prompts give bitwise-equal logits and the")
    echo("   same greedy tokens as an engine cold-started on v2 (course_lib.testing.assert_hot_equals_cold)")
    return None


def next_steps(mode: str) -> list[str]:
    """The closing lines: the other modes, then where to go from here."""
    others = ", ".join(m for m in MODES if m != mode)
    return [f"other pause modes: --mode {others} (same update, different costs)",
            "next: jupyter lab notebooks/  (the course: build this engine part by part)",
            "      python practice/judge.py list  (graded exercises and problems)",
            "      python -m course_lib serve --model DIR --allow-weight-update  (the same, over HTTP)"]


def main(mode: str = "retract", device: str | None = None, seed: int = 0, preset: str = "tiny") -> int:
    """Print the demo; 0 when hot == cold, 1 when not, 2 for bad options."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    problem = check_options(mode, device, preset)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    print(f"course_lib demo: a weight update lands mid-generation "
          f"(mode {mode}, {device}, preset {preset}, seed {seed})")
    result = run(mode, device, seed, preset, echo=print)
    print("")
    for line in next_steps(mode):
        print(line)
    if result["hot_equals_cold"] is not None:
        print(f"FAILED: the hot-updated engine differs from a cold start on v2: {result['hot_equals_cold']}",
              file=sys.stderr)
        return 1
    return 0
