"""EngineConfig holds every engine option, resolved; an engine "like this one" is built from it.
Also the update entry's options, and its refusal that still lets a source take a sender's bytes."""
import inspect
from dataclasses import dataclass

import pytest
import torch

from course_lib import Engine
from course_lib.config import ConfigError, EngineConfig
from course_lib.engine.pause import EngineBusyError
from course_lib.update.records import UpdateOptions
from course_lib.update.sources import SnapshotSource
from course_lib.testing import assert_hot_equals_cold, cold_engine_like
from course_lib.weights.checkpoint import CheckpointReader
from course_lib.weights.commit.validate import UpdateError


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    return make_ckpt("tiny", seed=1), make_ckpt("tiny", seed=2)


def test_an_engines_config_is_resolved_kv_blocks_included(ckpts):
    engine = Engine(ckpts[0], max_num_seqs=3, block_size=8, max_model_len=100, seed=7)
    c = engine.config
    assert (c.dtype, c.enable_cuda_graph, c.max_model_len) == (torch.float32, False, 100)
    assert c.max_num_batched_tokens == 4096
    assert c.num_kv_blocks == 3 * 13  # every slot's sequence at full length: ceil(100 / 8) blocks each
    assert engine.block_manager.num_free_blocks == c.num_kv_blocks == engine.model_runner.num_kv_blocks
    assert (c.seed, c.tp_rank, c.tp_size, c.load_format, c.quantization) == (7, 0, 1, "auto", None)
    assert c.resolved(engine.model_config) == c, "resolving a resolved config must change nothing"
    assert not c.is_cuda and EngineConfig(device="cuda:1").is_cuda


def test_max_model_len_is_capped_by_the_model_and_the_kv_pool_follows(ckpts):
    engine = Engine(ckpts[0], max_num_seqs=2, block_size=16, max_model_len=10**6)
    limit = engine.model_config.max_position_embeddings
    assert engine.config.max_model_len == limit
    assert engine.config.num_kv_blocks == 2 * -(-limit // 16)


def test_an_engine_built_from_another_ones_config_is_built_the_same(ckpts):
    engine = Engine(ckpts[0], max_num_seqs=3, num_kv_blocks=20, enable_prefix_caching=False, seed=5)
    twin = Engine(ckpts[1], config=engine.config)
    assert twin.config == engine.config
    assert len(twin.block_manager.blocks) == 20


def test_cold_engine_like_a_dummy_engine_reads_the_checkpoint(ckpts):
    engine = Engine(ckpts[0], load_format="dummy", max_num_seqs=2)
    cold = cold_engine_like(engine, ckpts[1])
    assert cold.config.load_format == "auto" and not cold.waiting_for_weights
    assert cold.config.max_num_seqs == 2
    name = "model.layers.0.mlp.down_proj.weight"
    on_disk = dict(CheckpointReader(ckpts[1]).iter_tensors([name]))[name]
    assert torch.equal(cold.get_weights_by_name(name, truncate_size=10**6), on_disk)


def test_hot_equals_cold_through_the_config(ckpts):
    engine = Engine(ckpts[0], max_num_seqs=2, block_size=8)
    engine.update_weights_from_disk(ckpts[1])
    assert_hot_equals_cold(engine, ckpts[1], ["cold like hot"], max_new_tokens=3)


@pytest.mark.parametrize("options, message", [
    (dict(load_format="safetensors"), "load_format must be"),
    (dict(max_num_seqs=0), "max_num_seqs must be positive"),
    (dict(max_model_len=512, max_num_batched_tokens=256), "max_num_batched_tokens"),
    (dict(dtype="float64"), "dtype must be"),
    (dict(enable_cuda_graph=True), "needs device='cuda'"),
])
def test_bad_options_are_refused_naming_the_option(ckpts, options, message):
    with pytest.raises(ConfigError, match=message):
        Engine(ckpts[0], **options)


def test_update_options_are_one_frozen_default():
    options = UpdateOptions()
    assert (options.weight_version, options.flush_cache, options.abort_all_requests) == (None, True, False)
    assert options.wait_timeout_s == inspect.signature(Engine.update_weights_from_disk).parameters["wait_timeout_s"].default
    with pytest.raises(AttributeError):
        options.flush_cache = False


@dataclass
class Recording(SnapshotSource):
    """A source that notes when the transaction tells it it was refused."""
    seen: list = None

    def refused(self, port, refusal):
        self.seen.append(refusal)


def test_a_refused_update_lets_its_source_take_the_bytes_then_raises_the_refusal(ckpts):
    engine = Engine(ckpts[0], max_model_len=64)
    engine.take_snapshot()
    engine.add_request("busy", {"max_new_tokens": 4})
    source = Recording(seen=[])
    with pytest.raises(EngineBusyError) as info:
        engine.update(source)
    assert source.seen == [info.value], "the source heard of the refusal before it was raised"
    with pytest.raises(Exception, match="told to refuse"):
        engine.update(Recording(seen=source.seen), UpdateOptions(abort_all_requests=True, refuse_with="told to refuse"))
    assert len(source.seen) == 2 and engine.weight_update_count == 0
    result = engine.update(Recording(seen=source.seen), UpdateOptions(abort_all_requests=True))
    assert len(source.seen) == 2 and result["writer"] == "snapshot" and engine.weight_update_count == 1
