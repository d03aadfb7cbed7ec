"""Tensor-parallel loaders: each rank's parameters are exactly its slices of the HF tensors.

Only loading is exercised (no forward pass), so no process group is needed: rank r of
tp_size=2 is built and loaded on its own, as each worker would.
"""
import pytest
import torch

from course_lib.config import ModelConfig
from course_lib.layers.quant import process_weights_after_loading, quantize_int8_per_channel
from course_lib.models.qwen3 import Qwen3ForCausalLM
from course_lib.weights.checkpoint import preset, random_state_dict

TP = 2


def load_rank(config: ModelConfig, state: dict, rank: int, tp_size: int = TP, quantization=None):
    model = Qwen3ForCausalLM(config, tp_rank=rank, tp_size=tp_size, quantization=quantization)
    tied_head = {"lm_head.weight"} if config.tie_word_embeddings else set()
    assert model.load_weights(state.items()) == set(state) - tied_head
    process_weights_after_loading(model)
    return model


def part(t: torch.Tensor, rank: int, dim: int = 0, tp_size: int = TP) -> torch.Tensor:
    size = t.shape[dim] // tp_size
    return t.narrow(dim, rank * size, size)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def setup(request):
    # 4 query heads over 2 kv heads: each rank gets 2 query heads and 1 kv head.
    config = preset("tiny", tie_word_embeddings=request.param)
    state = random_state_dict(config, seed=7)
    return config, state, [load_rank(config, state, r) for r in range(TP)]


def test_column_parallel_qkv_stacks_each_ranks_heads(setup):
    config, state, ranks = setup
    for n in range(config.num_hidden_layers):
        hf = {s: state[f"model.layers.{n}.self_attn.{s}_proj.weight"] for s in "qkv"}
        for r, model in enumerate(ranks):
            fused = model.get_parameter(f"model.layers.{n}.self_attn.qkv_proj.weight")
            assert fused.shape == ((config.num_attention_heads + 2 * config.num_key_value_heads)
                                   * config.head_dim // TP, config.hidden_size)
            assert torch.equal(fused, torch.cat([part(hf["q"], r), part(hf["k"], r), part(hf["v"], r)]))
        # Whole heads, not arbitrary rows: rank 1's first query row is head 2's first row.
        q1 = ranks[1].get_parameter(f"model.layers.{n}.self_attn.qkv_proj.weight")[0]
        assert torch.equal(q1, hf["q"][2 * config.head_dim])


def test_merged_gate_up_is_split_then_stacked(setup):
    config, state, ranks = setup
    i = config.intermediate_size
    for n in range(config.num_hidden_layers):
        gate, up = (state[f"model.layers.{n}.mlp.{s}_proj.weight"] for s in ("gate", "up"))
        for r, model in enumerate(ranks):
            fused = model.get_parameter(f"model.layers.{n}.mlp.gate_up_proj.weight")
            assert fused.shape == (i, config.hidden_size)  # 2 * i / TP
            assert torch.equal(fused, torch.cat([part(gate, r), part(up, r)]))


def test_row_parallel_splits_the_input_dimension(setup):
    config, state, ranks = setup
    for n in range(config.num_hidden_layers):
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            hf = state[f"model.layers.{n}.{name}.weight"]
            for r, model in enumerate(ranks):
                assert torch.equal(model.get_parameter(f"model.layers.{n}.{name}.weight"), part(hf, r, dim=1))


def test_vocab_parallel_embedding_and_lm_head(setup):
    config, state, ranks = setup
    head = state["model.embed_tokens.weight"] if config.tie_word_embeddings else state["lm_head.weight"]
    for r, model in enumerate(ranks):
        assert torch.equal(model.model.embed_tokens.weight, part(state["model.embed_tokens.weight"], r))
        assert torch.equal(model.lm_head.weight, part(head, r))
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == config.tie_word_embeddings


def test_norms_are_replicated(setup):
    config, state, ranks = setup
    for name, t in state.items():
        if name.endswith("norm.weight"):
            assert all(torch.equal(model.get_parameter(name), t) for model in ranks), name


def test_concatenating_the_ranks_rebuilds_every_hf_tensor(setup):
    config, state, ranks = setup
    q, kv = config.num_attention_heads * config.head_dim // TP, config.num_key_value_heads * config.head_dim // TP
    i = config.intermediate_size // TP
    rebuilt = {"model.embed_tokens.weight": torch.cat([m.model.embed_tokens.weight for m in ranks])}
    if not config.tie_word_embeddings:
        rebuilt["lm_head.weight"] = torch.cat([m.lm_head.weight for m in ranks])
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        qkv = [m.get_parameter(p + "self_attn.qkv_proj.weight").split([q, kv, kv]) for m in ranks]
        gate_up = [m.get_parameter(p + "mlp.gate_up_proj.weight").split([i, i]) for m in ranks]
        for k, s in enumerate("qkv"):
            rebuilt[p + f"self_attn.{s}_proj.weight"] = torch.cat([parts[k] for parts in qkv])
        rebuilt[p + "mlp.gate_proj.weight"] = torch.cat([parts[0] for parts in gate_up])
        rebuilt[p + "mlp.up_proj.weight"] = torch.cat([parts[1] for parts in gate_up])
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            rebuilt[p + name + ".weight"] = torch.cat([m.get_parameter(p + name + ".weight") for m in ranks], dim=1)
    for name, t in rebuilt.items():
        assert torch.equal(t, state[name]), name
    assert set(rebuilt) == {n for n in state if not n.endswith("norm.weight")}


def test_quantized_column_shards_equal_slices_of_the_full_quantization():
    """Per-row int8 scales see whole rows, so quantizing a column shard equals slicing the
    quantized full tensor (a row-parallel shard sees part of each row: its scales differ)."""
    config = preset("tiny")
    state = random_state_dict(config, seed=8)
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    full = load_rank(config, state, 0, tp_size=1, quantization="int8")
    for r in range(TP):
        model = load_rank(config, state, r, quantization="int8")
        for name, sizes in (("self_attn.qkv_proj", [q, kv, kv]), ("mlp.gate_up_proj", [config.intermediate_size] * 2)):
            whole = full.get_submodule(f"model.layers.0.{name}")
            mine = model.get_submodule(f"model.layers.0.{name}")
            assert torch.equal(mine.qweight, torch.cat([part(t, r) for t in whole.qweight.split(sizes)])), name
            assert torch.equal(mine.weight_scale, torch.cat([part(t, r) for t in whole.weight_scale.split(sizes)]))
        down = model.get_submodule("model.layers.0.mlp.down_proj")
        expected, _ = quantize_int8_per_channel(part(state["model.layers.0.mlp.down_proj.weight"], r, dim=1))
        assert torch.equal(down.qweight, expected)


# ---- refusals: a clear error naming what is wrong -------------------------------------------

@pytest.mark.parametrize("name,shape,match", [
    ("model.layers.1.self_attn.k_proj.weight", (16, 64), r"model\.layers\.1\.self_attn\.qkv_proj\.weight\[k\]"),
    ("model.layers.0.mlp.up_proj.weight", (128, 32), r"model\.layers\.0\.mlp\.gate_up_proj\.weight\[1\]"),
    ("model.layers.0.self_attn.o_proj.weight", (64, 32), r"model\.layers\.0\.self_attn\.o_proj\.weight"),
    ("model.embed_tokens.weight", (256, 64), r"model\.embed_tokens\.weight"),
])
def test_shape_mismatch_names_the_parameter(name, shape, match):
    config = preset("tiny")
    for quantization in (None, "int8"):
        model = Qwen3ForCausalLM(config, tp_rank=1, tp_size=TP, quantization=quantization)
        with pytest.raises(ValueError, match=match + r".*expected"):
            model.load_weights([(name, torch.zeros(shape))])


@pytest.mark.parametrize("tp_size,what", [(3, "num_attention_heads"), (4, "num_key_value_heads")])
def test_tp_size_must_divide_the_heads(tp_size, what):
    config = preset("tiny", vocab_size=516)  # divisible by 3 and 4, so the heads are what fails
    with pytest.raises(ValueError, match=rf"{what} \(\d+\) is not divisible by tensor_parallel_size \({tp_size}\)"):
        Qwen3ForCausalLM(config, tp_rank=0, tp_size=tp_size)
