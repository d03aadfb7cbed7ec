"""Remote seeding: a serving engine (a spawned process) sends its weights over a gloo group
to a new engine started with dummy weights. The new engine refuses work until they
arrive, ends hot == cold against the source's checkpoint, and refuses a source whose
model has a different structure."""
import multiprocessing as mp
import shutil

import pytest
import torch

from course_lib import Engine
from course_lib.config import ConfigError
from course_lib.testing import assert_addresses_unchanged, assert_hot_equals_cold, serve_checkpoint
from course_lib.weights.checkpoint import CheckpointReader
from course_lib.weights.transports import remote, trainer
from course_lib.weights.transports.remote import WaitingForWeightsError
from course_lib.weights.commit.validate import UpdateError
from course_lib.weights.transports.dist import free_port

PROMPTS = ["seeded from a peer", "no disk read"]
CTX = mp.get_context("spawn")  # forked children hang on torch's thread pools


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    """(the source's checkpoint, one with a different structure)."""
    return make_ckpt("tiny", seed=61), make_ckpt("tiny", seed=61, num_hidden_layers=3)


@pytest.fixture
def config_only(ckpts, tmp_path):
    """A directory with the source's config.json and no weights at all."""
    shutil.copy(ckpts[0] / "config.json", tmp_path / "config.json")
    return tmp_path


def start_source(checkpoint, port, results):
    child = CTX.Process(target=serve_checkpoint, args=(checkpoint, port, results),
                        kwargs={"bucket_bytes": 60_000})
    child.start()
    return child


def test_dummy_engine_refuses_work_until_weights_arrive(config_only):
    engine = Engine(config_only, load_format="dummy")  # no weights file: nothing is read from disk
    health = engine.health()
    assert health["ready"] is False and health["reason"] == "waiting for weights"
    with pytest.raises(WaitingForWeightsError, match="waiting for weights"):
        engine.generate("too early", {"max_new_tokens": 2})
    with pytest.raises(WaitingForWeightsError, match="waiting for weights"):
        engine.add_request("too early")
    assert not engine.has_unfinished_requests()
    with pytest.raises(ConfigError, match="load_format"):
        Engine(config_only, load_format="pickled")


def test_seeded_engine_equals_a_cold_start(ckpts, config_only):
    source_ckpt = ckpts[0]
    port, results = free_port(), CTX.Queue()
    child = start_source(source_ckpt, port, results)
    engine = Engine(config_only, load_format="dummy")
    source_norm = dict(CheckpointReader(source_ckpt).iter_tensors(["model.norm.weight"]))["model.norm.weight"]
    assert not torch.equal(engine.get_weights_by_name("model.norm.weight"), source_norm)  # dummy values
    result = engine.receive_weights_from_remote("127.0.0.1", port, timeout_s=120)
    stats = results.get(timeout=120)
    assert trainer.wait_for_exit(child) == 0
    assert "error" not in stats, stats
    assert stats["buckets"] > 2 and result["bytes"] == CheckpointReader(source_ckpt).nbytes()
    assert result["weight_version"] == "default"  # the source's version
    assert engine.health()["ready"] is True
    assert_hot_equals_cold(engine, source_ckpt, PROMPTS)
    assert_addresses_unchanged(engine)


def test_structurally_different_source_is_refused(ckpts, config_only):
    port, results = free_port(), CTX.Queue()
    child = start_source(ckpts[1], port, results)  # three layers; the new engine has two
    engine = Engine(config_only, load_format="dummy")
    with pytest.raises(UpdateError, match="num_hidden_layers"):
        engine.receive_weights_from_remote("127.0.0.1", port, timeout_s=120)
    told = results.get(timeout=120)
    assert trainer.wait_for_exit(child) == 0  # the source was told, and did not hang
    assert "refused" in told["error"] and "num_hidden_layers" in told["error"]
    assert engine.health()["ready"] is False and engine.weight_update_count == 0
    with pytest.raises(WaitingForWeightsError):
        engine.generate("still too early", {"max_new_tokens": 2})


def test_a_quantized_source_cannot_seed(ckpts):
    """Dequantized int8 values are not the checkpoint's floats: such a source says so in its
    manifest, and the new engine refuses it (no child process needed to check either side)."""
    engine = Engine(ckpts[0], quantization="int8")
    problem = remote.source_problem(engine)
    assert problem and "quantized" in problem
    manifest = {"error": problem, "config": engine.model_config.to_hf_dict(), "buckets": []}
    assert "quantized" in remote.check_manifest(manifest, engine.model_config)
    plain = Engine(ckpts[0])
    assert remote.source_problem(plain) is None
    good = {"error": None, "config": plain.model_config.to_hf_dict(),
            "buckets": remote.plan(plain.model_config, plain.config.dtype, 60_000)}
    assert remote.check_manifest(good, plain.model_config) is None
    short = dict(good, buckets=good["buckets"][:-1])  # a tensor missing
    assert "not this model's" in remote.check_manifest(short, plain.model_config)
