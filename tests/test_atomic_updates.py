"""Nothing half-written stays: a disk update refused midway (a bad value in a later tensor,
a file truncated or rewritten while it is read) puts back the layers it wrote, so the engine
serves the old weights, healthy; a tensor stored twice is refused by cold start and update
alike. Faults through the engine API and over a real server."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from course_lib import Engine
from course_lib.layers.quant import kernel_tensors
from course_lib.testing import assert_addresses_unchanged, assert_hot_equals_cold
from course_lib.weights.checkpoint import CheckpointError, CheckpointReader, write_checkpoint
from course_lib.weights.commit.validate import UpdateError

PROMPTS = ["nothing half-written", "stays"]
ROOT = Path(__file__).resolve().parents[1]
# Last in the file (safetensors orders tensors by name): every other layer is written first.
LATE = "model.norm.weight"


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    return make_ckpt("tiny", seed=91), make_ckpt("tiny", seed=92)


def with_value(src, dst, value, name=LATE):
    tensors = dict(CheckpointReader(src).iter_tensors())
    tensors[name][-1] = value
    return write_checkpoint(dst, CheckpointReader(src).config, tensors)


def clone_weights(engine):
    return {k: v.clone() for k, v in kernel_tensors(engine.model).items()}


def assert_serves_old(engine, before, old_ckpt):
    after = kernel_tensors(engine.model)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"refused update left new values in {changed[:3]}"
    assert engine.health()["healthy"], engine.health()
    assert engine.weight_update_count == 0 and engine.get_weight_version() == "default"
    assert_hot_equals_cold(engine, old_ckpt, PROMPTS)
    assert_addresses_unchanged(engine)


@pytest.mark.parametrize("quantization", [None, "int8"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_bad_value_in_a_later_tensor_is_refused_and_the_old_weights_serve(ckpts, tmp_path, value, quantization):
    a, b = ckpts
    engine = Engine(a, quantization=quantization)
    before = clone_weights(engine)
    with pytest.raises(UpdateError, match=r"after \d+ layers were written.*restored"):
        engine.update_weights_from_disk(with_value(b, tmp_path / "bad", value), weight_version="v2")
    assert_serves_old(engine, before, a)
    engine.update_weights_from_disk(b, weight_version="v2")  # a good update after the refusal
    assert_hot_equals_cold(engine, b, PROMPTS)


def test_rollback_point_is_reported_and_no_bigger_than_the_model(ckpts):
    a, b = ckpts
    engine = Engine(a)
    memory = engine.update_weights_from_disk(b)["memory"]
    model_bytes = sum(t.numel() * t.element_size() for t in kernel_tensors(engine.model).values())
    assert 0 < memory["rollback_peak_bytes"] <= model_bytes
    # With a full snapshot kept, the snapshot is the rollback point: no second copy.
    assert engine.update_weights_from_disk(a, keep_snapshot=True)["memory"]["rollback_peak_bytes"] == 0


def duplicated_across_shards(src, dst):
    """A sharded checkpoint whose first shard also holds a tensor of the last shard."""
    tensors = dict(CheckpointReader(src).iter_tensors())
    path = write_checkpoint(dst, CheckpointReader(src).config, tensors, max_shard_size=60_000)
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    assert len(files) > 1
    last_name = next(n for n, f in weight_map.items() if f == files[-1])
    first = load_file(path / files[0])
    first[last_name] = tensors[last_name] + 1.0  # a different value: which one is the weight?
    save_file(first, str(path / files[0]), metadata={"format": "pt"})
    return path, last_name


def test_tensor_stored_in_two_shards_is_refused_by_cold_start_and_update_alike(ckpts, tmp_path):
    a, b = ckpts
    dup, name = duplicated_across_shards(b, tmp_path / "dup")
    with pytest.raises(CheckpointError, match=f"{name} is stored twice"):
        Engine(dup)
    engine = Engine(a)
    before = clone_weights(engine)
    with pytest.raises(UpdateError, match=f"{name} is stored twice"):
        engine.update_weights_from_disk(dup)
    assert_serves_old(engine, before, a)


# Run in a child process: before reads stopped using a memory map, the truncation killed
# the process with SIGBUS (which would take pytest down with it).
REWRITE_MIDWAY = textwrap.dedent("""
    import os, sys, torch
    from course_lib import Engine
    from course_lib.layers.quant import kernel_tensors
    from course_lib.weights.checkpoint import CheckpointReader
    from course_lib.weights.commit.validate import UpdateError
    old, new, how = sys.argv[1:4]
    engine = Engine(old)
    before = {k: v.clone() for k, v in kernel_tensors(engine.model).items()}
    original = CheckpointReader.iter_tensors
    file = os.path.join(new, "model.safetensors")

    def iter_tensors(self, *args, **kwargs):
        for k, item in enumerate(original(self, *args, **kwargs)):
            yield item
            if k == 2:  # three tensors in (two layers written): the trainer rewrites the file in place
                data = open(file, "rb").read()
                with open(file, "r+b") as f:
                    f.truncate(len(data) // 3)
                    if how == "same size":
                        f.seek(0, 2)
                        f.write(bytes(len(data) - len(data) // 3))
    CheckpointReader.iter_tensors = iter_tensors
    try:
        engine.update_weights_from_disk(new)
        sys.exit("the update of a checkpoint rewritten midway was accepted")
    except UpdateError as exc:
        print("refused:", exc)
    after = kernel_tensors(engine.model)
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused update changed weights"
    assert engine.health()["healthy"]
    engine.generate("still serving", {"max_new_tokens": 2})
""")


@pytest.mark.parametrize("how", ["truncated", "same size"])
def test_checkpoint_rewritten_in_place_during_an_update_is_refused_not_a_crash(ckpts, tmp_path, how):
    a, b = ckpts
    new = shutil.copytree(b, tmp_path / "new")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", REWRITE_MIDWAY, str(a), str(new), how], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode} (-7 is SIGBUS)\n{proc.stdout}\n{proc.stderr[-3000:]}"
    expected = "truncated while being read" if how == "truncated" else "changed while being read"
    assert expected in proc.stdout and "restored" in proc.stdout, proc.stdout


def test_checkpoint_replaced_after_validation_is_refused(ckpts, tmp_path):
    """A file replaced between the header check and the read (same names and shapes, new
    bytes) is refused rather than read: its values were never the validated ones."""
    _, b = ckpts
    new = shutil.copytree(b, tmp_path / "new")
    reader = CheckpointReader(new)
    reader.metadata()
    other = with_value(b, tmp_path / "other", 0.5)
    os.replace(other / "model.safetensors", new / "model.safetensors")
    with pytest.raises(CheckpointError, match="changed since it was validated"):
        next(reader.iter_tensors())


pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")


def test_refused_disk_update_over_http_leaves_the_server_serving_the_old_weights(ckpts, tmp_path):
    from course_lib.server.runner import BackgroundServer
    a, b = ckpts
    bad = with_value(b, tmp_path / "nan", float("nan"))
    greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    expected = Engine(a).generate(PROMPTS, greedy)
    engine = Engine(a)
    before = clone_weights(engine)
    with BackgroundServer(engine, allow_weight_update=True) as srv:
        for _ in range(2):  # twice: a refusal leaves nothing behind that breaks the next one
            reply = httpx.post(f"{srv.url}/update_weights_from_disk", json={"model_path": str(bad)}, timeout=60)
            assert reply.status_code == 400, reply.text
            assert "restored" in reply.json()["error"]["message"]
        health = httpx.get(f"{srv.url}/health", timeout=30)
        assert health.status_code == 200, health.text
        reply = httpx.post(f"{srv.url}/generate", json={"text": PROMPTS, "sampling_params": greedy}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert [r["output_ids"] for r in reply.json()] == [e["output_ids"] for e in expected]
        srv.worker.call_sync(lambda e: assert_serves_old(e, before, a), timeout=60)
        reply = httpx.post(f"{srv.url}/update_weights_from_disk", json={"model_path": str(b)}, timeout=60)
        assert reply.status_code == 200, reply.text
        srv.worker.call_sync(lambda e: assert_hot_equals_cold(e, b, PROMPTS), timeout=60)
