"""Hidden tests for chapter 01: the learner's loaders and block hash inside the real engine.

Fresh random shapes, checkpoints and prompts each run (the seed is printed with every
failure). Expected values are worked out here from the checkpoint and the config, never
by asking the learner's code; addresses and values are read in this process.
"""
import random

import pytest
import torch

from course_lib import Engine
from course_lib.engine.block_manager import BlockManager
from course_lib.engine.sequence import SamplingParams, Sequence
from course_lib.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                      RowParallelLinear)
from course_lib.models.qwen3 import Qwen3ForCausalLM
from course_lib.testing import assert_addresses_unchanged, assert_hot_equals_cold, prompt_logits
from course_lib.weights.checkpoint import CheckpointReader, make_random, preset, random_state_dict
from conftest import hidden_seed  # the judge's plugin: a fixed seed, so a grade repeats

SEED = hidden_seed()
GREEDY = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
PROMPTS = ["Hello there", "The weights change while it serves", "x"]
# (query heads, key/value heads): multi-head, grouped-query and multi-query attention.
HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}

qkv_rows = pytest.mark.exercise("ch01.qkv_rows")
gate_up_rows = pytest.mark.exercise("ch01.gate_up_rows")
tp_slice = pytest.mark.exercise("ch01.tp_slice")
local_loader = pytest.mark.exercise("ch01.local_loader")
block_hash = pytest.mark.exercise("ch01.block_hash")


@pytest.fixture
def rng(request):
    # One stream per test, derived from the run's seed, so each failure can be replayed.
    return random.Random(f"{SEED}/{request.node.name}")


def where(msg: str) -> str:
    return f"{msg} (seed {SEED})"


def config_for(kind: str, rng: random.Random, **overrides):
    heads, kv = HEADS[kind]
    head_dim = rng.choice([4, 8, 12])
    return preset("tiny", num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                  intermediate_size=rng.choice([32, 48, 96]), **overrides)


def part(t: torch.Tensor, rank: int, tp: int, dim: int = 0) -> torch.Tensor:
    size = t.shape[dim] // tp
    return t.narrow(dim, rank * size, size)


def load_rank(config, state, rank, tp):
    model = Qwen3ForCausalLM(config, tp_rank=rank, tp_size=tp)
    before = {name: (p.data_ptr(), tuple(p.shape)) for name, p in model.named_parameters()}
    model.load_weights(state.items())
    moved = [n for n, p in model.named_parameters() if (p.data_ptr(), tuple(p.shape)) != before[n]]
    assert not moved, where(f"rank {rank} of {tp}: loading moved the storage of {moved[:3]}: copy in place")
    return model


# ---- ch01.qkv_rows ---------------------------------------------------------------------

@qkv_rows
@pytest.mark.parametrize("kind", sorted(HEADS))
def test_qkv_rows_for_random_layers_on_every_rank(kind, rng):
    heads, kv = HEADS[kind]
    for tp in [t for t in (1, 2, 4) if kv % t == 0]:
        head_dim = rng.randrange(1, 40)
        for rank in range(tp):
            layer = QKVParallelLinear(rng.randrange(1, 9), head_dim, heads, kv, tp_rank=rank, tp_size=tp)
            q, k = heads // tp * head_dim, kv // tp * head_dim
            want = {"q": (0, q), "k": (q, k), "v": (q + k, k)}
            got = {s: tuple(layer.shard_rows(s)) for s in "qkv"}
            assert got == want, where(f"{heads} q heads, {kv} kv heads of {head_dim} rows, rank {rank} of {tp}: "
                                      f"expected {want}, got {got}")
    for bad in ("qkv", None, 0, "Q"):
        with pytest.raises(ValueError):
            QKVParallelLinear(8, 4, heads, kv).shard_rows(bad)


@qkv_rows
@pytest.mark.parametrize("kind", sorted(HEADS))
def test_qkv_rows_real_model_holds_each_ranks_heads(kind, rng):
    config = config_for(kind, rng)
    state = random_state_dict(config, seed=rng.randrange(10_000))
    d = config.head_dim
    for tp in [t for t in (1, 2) if config.num_key_value_heads % t == 0]:
        for rank in range(tp):
            model = load_rank(config, state, rank, tp)
            for n in range(config.num_hidden_layers):
                hf = [state[f"model.layers.{n}.self_attn.{s}_proj.weight"] for s in "qkv"]
                fused = model.get_parameter(f"model.layers.{n}.self_attn.qkv_proj.weight")
                want = torch.cat([part(t, rank, tp) for t in hf])
                assert torch.equal(fused, want), where(
                    f"{kind}, layer {n}, rank {rank} of {tp}: qkv_proj is not this rank's q heads, then its k "
                    f"heads, then its v heads ({config.num_attention_heads} q and {config.num_key_value_heads} kv "
                    f"heads of {d} rows)")


@qkv_rows
@pytest.mark.parametrize("kind", sorted(HEADS))
def test_qkv_rows_hot_update_equals_cold_start(kind, rng, tmp_path):
    # A hot update on one rank goes through the copy plan, which is built from shard_rows.
    config = config_for(kind, rng)
    old_seed, new_seed = rng.sample(range(10_000), 2)  # never equal: an update to the same weights proves nothing
    old = make_random(tmp_path / "old", config, seed=old_seed)
    new = make_random(tmp_path / "new", config, seed=new_seed)
    engine = Engine(old)
    engine.update_weights_from_disk(str(new))
    assert_hot_equals_cold(engine, new, PROMPTS, max_new_tokens=3)
    assert_addresses_unchanged(engine)
    for s in "qkv":
        name = f"model.layers.1.self_attn.{s}_proj.weight"
        full = dict(CheckpointReader(new).iter_tensors())[name]
        got = engine.get_weights_by_name(name, truncate_size=10**6)
        assert torch.equal(got, full), where(f"{kind}: get_weights_by_name({name!r}) is not the checkpoint's tensor")


# ---- ch01.gate_up_rows -----------------------------------------------------------------

@gate_up_rows
def test_gate_up_rows_for_random_outputs_on_every_rank(rng):
    for _ in range(20):
        tp = rng.choice([1, 2, 4])
        sizes = [tp * rng.randrange(1, 20) for _ in range(rng.choice([2, 2, 3]))]
        for rank in range(tp):
            layer = MergedColumnParallelLinear(rng.randrange(1, 9), sizes, tp_rank=rank, tp_size=tp)
            want, first = [], 0
            for s in sizes:
                want.append((first, s // tp))
                first += s // tp
            got = [tuple(layer.shard_rows(i)) for i in range(len(sizes))]
            assert got == want, where(f"outputs {sizes}, rank {rank} of {tp}: expected {want}, got {got}")
        for bad in (len(sizes), -1, "gate", None):
            with pytest.raises(ValueError):
                layer.shard_rows(bad)


@gate_up_rows
def test_gate_up_rows_real_model_on_two_ranks(rng):
    config = config_for("gqa", rng)
    state = random_state_dict(config, seed=rng.randrange(10_000))
    for rank in range(2):
        model = load_rank(config, state, rank, 2)
        for n in range(config.num_hidden_layers):
            gate, up = (state[f"model.layers.{n}.mlp.{s}_proj.weight"] for s in ("gate", "up"))
            fused = model.get_parameter(f"model.layers.{n}.mlp.gate_up_proj.weight")
            assert torch.equal(fused, torch.cat([part(gate, rank, 2), part(up, rank, 2)])), where(
                f"layer {n}, rank {rank} of 2: gate_up_proj is not this rank's gate rows, then its up rows")


@gate_up_rows
def test_gate_up_rows_hot_update_equals_cold_start(rng, tmp_path):
    config = config_for("gqa", rng)
    old_seed, new_seed = rng.sample(range(10_000), 2)  # never equal: an update to the same weights proves nothing
    old = make_random(tmp_path / "old", config, seed=old_seed)
    new = make_random(tmp_path / "new", config, seed=new_seed)
    engine = Engine(old)
    engine.update_weights_from_disk(str(new))
    assert_hot_equals_cold(engine, new, PROMPTS, max_new_tokens=3)


# ---- ch01.tp_slice ---------------------------------------------------------------------

@tp_slice
def test_tp_slice_random_shapes_every_rank(rng):
    for _ in range(20):
        tp, dim = rng.choice([1, 2, 3, 4]), rng.choice([0, 1])
        shape = [rng.randrange(1, 6), rng.randrange(1, 6)]
        shape[dim] *= tp
        full = torch.randn(*shape)
        parts = []
        for rank in range(tp):
            layer = ColumnParallelLinear(4, 4 * tp, tp_rank=rank, tp_size=tp)
            got = layer._shard(full, dim)
            size = shape[dim] // tp
            want = full.narrow(dim, rank * size, size)
            assert torch.equal(got, want), where(f"shape {tuple(shape)} along dim {dim}, rank {rank} of {tp}: "
                                                 f"expected indices {rank * size}..{(rank + 1) * size}")
            assert got.untyped_storage().data_ptr() == full.untyped_storage().data_ptr(), \
                where("the slice is a copy; it should be a view of the checkpoint tensor")
            parts.append(got)
        assert torch.equal(torch.cat(parts, dim), full), where("the ranks' slices do not put the tensor back together")
    full = torch.randn(4, 6)  # columns of a row-major tensor: a view, never a contiguous copy
    got = RowParallelLinear(6, 4, tp_rank=1, tp_size=2)._shard(full, 1)
    assert got.untyped_storage().data_ptr() == full.untyped_storage().data_ptr(), \
        where("the column slice is a copy; it should be a view of the checkpoint tensor")
    for tp, n in [(2, 5), (4, 6), (3, 4)]:
        with pytest.raises(ValueError):
            ColumnParallelLinear(4, 4 * tp, tp_rank=0, tp_size=tp)._shard(torch.randn(n, 3), 0)
        with pytest.raises(ValueError):
            RowParallelLinear(4 * tp, 4, tp_rank=0, tp_size=tp)._shard(torch.randn(3, n), 1)


@tp_slice
def test_tp_slice_real_model_row_and_column_parallel(rng):
    config = config_for("gqa", rng)
    state = random_state_dict(config, seed=rng.randrange(10_000))
    for rank in range(2):
        model = load_rank(config, state, rank, 2)
        for n in range(config.num_hidden_layers):
            for name, dim in [("self_attn.o_proj", 1), ("mlp.down_proj", 1), ("self_attn.qkv_proj", 0)]:
                got = model.get_parameter(f"model.layers.{n}.{name}.weight")
                if name.endswith("qkv_proj"):
                    hf = [state[f"model.layers.{n}.self_attn.{s}_proj.weight"] for s in "qkv"]
                    want = torch.cat([part(t, rank, 2) for t in hf])
                else:
                    want = part(state[f"model.layers.{n}.{name}.weight"], rank, 2, dim)
                assert torch.equal(got, want), where(f"layer {n} {name}, rank {rank} of 2: not the checkpoint's "
                                                     f"slice along dim {dim}")


# ---- ch01.local_loader -----------------------------------------------------------------

def _filled_qkv(rng):
    heads, kv = HEADS[rng.choice(sorted(HEADS))]
    d, hidden = rng.randrange(2, 9), rng.randrange(3, 9)
    layer = QKVParallelLinear(hidden, d, heads, kv)
    layer.weight.data.copy_(torch.randn(layer.weight.shape))
    layer.weight.param_name = "qkv_proj.weight"
    return layer, layer.weight, heads, kv, d, hidden


@local_loader
def test_local_loader_writes_exactly_its_rows_in_place(rng):
    for _ in range(10):
        layer, param, heads, kv, d, hidden = _filled_qkv(rng)
        rows = {"q": (0, heads * d), "k": (heads * d, kv * d), "v": ((heads + kv) * d, kv * d)}
        for shard in rng.sample("qkv", 3):
            before, address = param.detach().clone(), param.data_ptr()
            first, n = rows[shard]
            new = torch.randn(n, hidden)
            layer.local_loader(param, new, shard)
            assert param.data_ptr() == address, where("storage address changed: copy in place, never rebind")
            want = before.clone()
            want[first:first + n] = new
            assert torch.equal(param.detach(), want), where(
                f"loading {shard} ({n} rows at {first}) should change exactly those rows")


@local_loader
def test_local_loader_refuses_wrong_shapes_and_writes_nothing(rng):
    layer, param, heads, kv, d, hidden = _filled_qkv(rng)
    n = kv * d
    bad = [torch.randn(hidden, n) if hidden != n else torch.randn(n + 1, hidden),  # transposed
           torch.randn(n * hidden).reshape(1, n * hidden),                          # right count, wrong shape
           torch.randn(1, hidden),                                                  # would broadcast
           torch.randn(hidden),                                                     # would broadcast
           torch.randn(n, hidden, 1),
           torch.empty(0, hidden)]                                                  # empty
    for t in bad:
        before = param.detach().clone()
        with pytest.raises(ValueError):
            layer.local_loader(param, t, "k")
        assert torch.equal(param.detach(), before), where(f"a refused shard of shape {tuple(t.shape)} wrote into "
                                                          "the weight: check the shape before copying")


@local_loader
def test_local_loader_converts_dtype_into_the_same_storage(rng):
    layer = ColumnParallelLinear(6, 8)
    layer.weight.data = layer.weight.data.to(torch.bfloat16)  # the engine's dtype, set up by the test
    layer.weight.param_name = "proj.weight"
    address, new = layer.weight.data_ptr(), torch.randn(8, 6)
    layer.local_loader(layer.weight, new)
    assert layer.weight.dtype == torch.bfloat16 and layer.weight.data_ptr() == address, \
        where("the weight's dtype or address changed: copy_ converts into the existing storage")
    assert torch.equal(layer.weight, new.to(torch.bfloat16)), where("the values are not the shard's")


@local_loader
def test_local_loader_resharded_shards_load_like_full_tensors(rng):
    # load_local_weights hands each parameter's local_loader this rank's parts directly.
    config = config_for("gqa", rng)
    state = random_state_dict(config, seed=rng.randrange(10_000))
    for rank in range(2):
        ref = load_rank(config, state, rank, 2)
        model = Qwen3ForCausalLM(config, tp_rank=rank, tp_size=2)
        before = {n: p.data_ptr() for n, p in model.named_parameters()}
        local = {}
        for name, t in state.items():
            if name == "lm_head.weight" or ".embed_tokens." in name:
                local[name] = part(t, rank, 2)  # vocab-parallel rows
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                local[name] = part(t, rank, 2, 1)
            elif t.dim() == 2:
                local[name] = part(t, rank, 2)
            else:
                local[name] = t
        model.load_local_weights(local.items())
        for n, p in model.named_parameters():
            assert p.data_ptr() == before[n], where(f"rank {rank}: {n} moved while loading local shards")
            assert torch.equal(p, ref.get_parameter(n)), where(f"rank {rank}: {n} differs from a full-tensor load")


@local_loader
@pytest.mark.parametrize("kind", sorted(HEADS))
def test_local_loader_engine_logits_equal_transformers(kind, rng, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = config_for(kind, rng, tie_word_embeddings=rng.random() < 0.5)
    ckpt = make_random(tmp_path / "ckpt", config, seed=rng.randrange(10_000))
    engine = Engine(ckpt)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    ids = [rng.randrange(256) for _ in range(rng.randrange(1, 30))]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = prompt_logits(engine, ids)
    rel = ((ours - ref).norm() / ref.norm()).item()
    assert rel < 1e-4, where(f"{kind}: the engine's logits differ from transformers' (relative difference {rel:.1e})")


# ---- ch01.block_hash -------------------------------------------------------------------

def _tokens(rng, n):
    return [rng.randrange(256) for _ in range(n)]


def _prompts(rng, bs):
    x, y = _tokens(rng, bs), _tokens(rng, bs)
    z = _tokens(rng, bs)
    while z == x:
        z = _tokens(rng, bs)
    system = _tokens(rng, bs * rng.randint(2, 3))

    def tail():
        return _tokens(rng, rng.randint(1, bs - 1))

    return [x + y + tail(), z + y + tail(), x + y + tail(), z + y + y + tail(),
            system + tail(), system + _tokens(rng, bs) + tail(), system[:bs] + tail()]


def _expected_cached(prompts, bs):
    """What a correct chained hash serves: whole blocks of the longest prefix an earlier prompt shares
    (never the block holding the last token, whose logits are needed)."""
    out = []
    for i, p in enumerate(prompts):
        best = 0
        for e in prompts[:i]:
            n = 0
            while n < min(len(p), len(e)) and p[n] == e[n]:
                n += 1
            best = max(best, n)
        out.append(min(best // bs, (len(p) - 1) // bs) * bs)
    return out


@block_hash
@pytest.mark.parametrize("bs", [4, 8])
def test_block_hash_engine_equals_no_cache_and_serves_exactly_the_shared_blocks(rng, bs, tmp_path):
    ckpt = make_random(tmp_path / "ckpt", "tiny", seed=rng.randrange(10_000))
    prompts = _prompts(rng, bs)
    engine = Engine(ckpt, block_size=bs)
    cold = Engine(ckpt, block_size=bs, enable_prefix_caching=False)
    want = _expected_cached(prompts, bs)
    for i, p in enumerate(prompts):
        got = engine.generate(input_ids=[p], sampling_params=GREEDY)[0]
        ref = cold.generate(input_ids=[p], sampling_params=GREEDY)[0]
        at = f"block size {bs}, request {i + 1} of {len(prompts)} ({len(p)} tokens)"
        assert got["output_ids"] == ref["output_ids"], \
            where(f"{at}: the output differs from an engine with no prefix cache (a block's KV was reused wrongly)")
        assert got["meta_info"]["cached_tokens"] == want[i], \
            where(f"{at}: the cache served {got['meta_info']['cached_tokens']} tokens, a chained hash serves {want[i]}")


@block_hash
def test_block_hash_differs_for_blocks_after_different_prefixes(rng):
    bm = BlockManager(num_blocks=8, block_size=4)
    for _ in range(20):
        a, b, block = _tokens(rng, 4), _tokens(rng, 4), _tokens(rng, 4)
        if a == b:
            continue
        ha, hb = bm.compute_hash(a, -1), bm.compute_hash(b, -1)
        deep_a, deep_b = bm.compute_hash(block, ha), bm.compute_hash(block, hb)
        assert deep_a != deep_b, where(f"block {block} hashes the same after {a} and after {b}")
        assert bm.compute_hash(block, deep_a) != bm.compute_hash(block, deep_b), \
            where(f"the third block {block} hashes the same after prefixes that differ in the first block")


@block_hash
def test_block_hash_is_order_sensitive_and_salted(rng):
    bm = BlockManager(num_blocks=8, block_size=4)
    block = rng.sample(range(256), 4)
    assert bm.compute_hash(block, -1) != bm.compute_hash(block[::-1], -1), where(f"{block} and its reverse hash the same")
    h = bm.compute_hash(block, 7)
    bm.salt = rng.randrange(1, 1000)
    assert bm.compute_hash(block, 7) != h, where(f"salt {bm.salt} gives the same hash as salt 0")


@block_hash
def test_block_hash_a_new_salt_makes_every_cached_block_unreachable(rng):
    bm = BlockManager(num_blocks=32, block_size=4)
    params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    prompt = _tokens(rng, 13)
    for salt, want in [(0, 0), (0, 12), (5, 0), (5, 12)]:
        bm.salt = salt
        seq = Sequence(prompt, params, block_size=4)
        bm.allocate(seq)
        served = seq.num_cached_tokens  # deallocate resets it
        bm.deallocate(seq)
        assert served == want, where(f"with salt {salt} the cache served {served} tokens, expected {want}")


# Salts and prefixes near each other (a salt added to or XORed with the prefix makes some of
# these meet), tokens one apart, reversed or rotated. -2 is left out on purpose: Python
# hashes -1 and -2 alike, so a correct tuple hash cannot tell those two prefixes apart.
NEAR_SALTS = [0, 1, 2, 3, 7]
NEAR_PREFIXES = [-1, 0, 1, 2, 5, 6, 7, 8]


def _variants(block):
    one_up = block[:-1] + [(block[-1] + 1) % 256]
    first_up = [(block[0] + 1) % 256] + block[1:]
    return {"the block": block, "its last token + 1": one_up, "its first token + 1": first_up,
            "reversed": block[::-1], "rotated": block[1:] + block[:1]}


def _hash_under(salt, tokens, prefix):
    bm = BlockManager(num_blocks=8, block_size=len(tokens))
    bm.salt = salt
    return bm.compute_hash(list(tokens), prefix)


def _first_wrong_pair(items):
    """items: (label, key, hash). The first pair whose hashes are equal while their keys
    differ, or differ while their keys are equal; None when the hash tells keys apart exactly."""
    by_hash, by_key = {}, {}
    for label, k, h in items:
        if h in by_hash and by_hash[h][1] != k:
            return by_hash[h][0], label, "the same hash", "different"
        if k in by_key and by_key[k][2] != h:
            return by_key[k][0], label, "different hashes", "equal"
        by_hash.setdefault(h, (label, k))
        by_key.setdefault(k, (label, k, h))
    return None


@block_hash
def test_block_hash_equal_exactly_when_salt_prefix_and_tokens_are(rng):
    block = rng.sample(range(256), 4)
    items = []
    for salt in NEAR_SALTS + [rng.randrange(10, 10**6)]:
        for prefix in NEAR_PREFIXES + [rng.randrange(10, 2**62)]:
            for what, tokens in _variants(block).items():
                label = f"salt {salt}, prefix {prefix}, {what} {tokens}"
                items.append((label, (salt, prefix, tuple(tokens)), _hash_under(salt, tokens, prefix)))
                # The same three again, from another BlockManager: the same hash.
                items.append((label + " (again)", (salt, prefix, tuple(tokens)), _hash_under(salt, tokens, prefix)))
    wrong = _first_wrong_pair(items)
    assert wrong is None, where(
        f"compute_hash gives {wrong[2]} for [{wrong[0]}] and [{wrong[1]}], whose salt, prefix and tokens are "
        f"{wrong[3]}: it must be equal exactly when the salt, the prefix and the tokens (in order) are equal")


@block_hash
def test_block_hash_keys_that_print_alike_are_different(rng):
    # Keys whose numbers, written out and joined without separators, read the same: a hash of
    # such a string would serve one request another's KV.
    items = []
    for label, salt, prefix, tokens in [
            ("tokens [1, 23, 4, 5]", 0, -1, [1, 23, 4, 5]), ("tokens [12, 3, 4, 5]", 0, -1, [12, 3, 4, 5]),
            ("tokens [1, 1, 14, 5]", 0, -1, [1, 1, 14, 5]), ("tokens [11, 1, 4, 5]", 0, -1, [11, 1, 4, 5]),
            ("salt 1, prefix 23", 1, 23, [4, 5, 6, 7]), ("salt 12, prefix 3", 12, 3, [4, 5, 6, 7]),
            ("prefix 1, tokens [23, 4, 5, 6]", 0, 1, [23, 4, 5, 6]), ("prefix 12, tokens [3, 4, 5, 6]", 0, 12, [3, 4, 5, 6]),
            ("prefix -1, tokens [2, 3, 4, 5]", 0, -1, [2, 3, 4, 5]), ("prefix -12, tokens [3, 4, 5]", 0, -12, [3, 4, 5])]:
        items.append((label, (salt, prefix, tuple(tokens)), _hash_under(salt, tokens, prefix)))
    wrong = _first_wrong_pair(items)
    assert wrong is None, where(
        f"compute_hash gives {wrong[2]} for [{wrong[0]}] and [{wrong[1]}], whose salt, prefix and tokens are "
        f"{wrong[3]}: numbers that read alike when joined are still different keys")


def _chains(rng):
    a, b, c = (rng.sample(range(256), 4) for _ in range(3))
    named = {"A": a, "B": b, "C": c, "A'": a[:-1] + [(a[-1] + 1) % 256]}
    seqs = [[x] for x in "ABC"] + [[x, y] for x in "ABC" for y in "ABC"]
    seqs += [[x, y, z] for x in "ABC" for y in "ABC" for z in "ABC"]
    seqs += [["A'", "B"], ["A'", "B", "C"], ["B", "A'"], ["A", "B", "A'"]]
    return named, seqs


@block_hash
def test_block_hash_chains_equal_exactly_for_equal_salt_and_prefix(rng):
    # A block's hash stands for the salt and every token up to the block's end, in order:
    # blocks swapped, a block repeated, one token apart, another salt: all different keys.
    named, seqs = _chains(rng)
    items = []
    for salt in [0, 1, 2, rng.randrange(3, 10**6)]:
        bm = BlockManager(num_blocks=8, block_size=4)
        bm.salt = salt
        for seq in seqs:
            h, tokens = -1, []
            for k, name in enumerate(seq):
                h = bm.compute_hash(list(named[name]), h)
                tokens += named[name]
                items.append((f"salt {salt}, block {k + 1} of {'+'.join(seq)}", (salt, tuple(tokens)), h))
    wrong = _first_wrong_pair(items)
    blocks = ", ".join(f"{n} = {t}" for n, t in named.items())
    assert wrong is None, where(
        f"chained block hashes: {wrong[2]} for [{wrong[0]}] and [{wrong[1]}] ({blocks}), whose salt and tokens up "
        f"to that block are {wrong[3]}: equal hashes must mean the same salt and the same prefix, in order")


@block_hash
def test_block_hash_swapped_blocks_are_different_cache_entries(rng):
    # x + y, then y + x, then x + y again: the third request finds x + y still cached.
    named, _ = _chains(rng)
    x, y = named["A"], named["B"]
    bm = BlockManager(num_blocks=64, block_size=4)
    params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    tail = [rng.randrange(256)]
    for label, prompt, want in [("x + y", x + y + tail, 0), ("y + x", y + x + tail, 0),
                                ("x + y again", x + y + tail, 8), ("y + x again", y + x + tail, 8)]:
        seq = Sequence(prompt, params, block_size=4)
        bm.allocate(seq)
        served = seq.num_cached_tokens
        bm.deallocate(seq)
        assert served == want, where(f"after x + y and y + x (x = {x}, y = {y}), {label} was served {served} cached "
                                     f"tokens, expected {want}: swapped blocks are different prefixes")
