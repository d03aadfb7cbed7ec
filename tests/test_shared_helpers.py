"""The small mechanisms every module shares, one of each: the dtype parser (``dtypes.py``),
``bucket.align_up``, the linear-time bucket grouper (``bucket.group_into_buckets``) and
the environment settings (``settings.py``)."""
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from course_lib import dtypes, settings
from course_lib.config import ConfigError, ModelConfig, resolve_dtype
from course_lib.dtypes import DtypeError, dtype_name, parse_dtype, parse_dtypes, parse_safetensors_dtype
from course_lib.server.errors import ApiError
from course_lib.server.schemas import DistributedUpdateRequest, check_announced_tensors
from course_lib.weights.transports import bucket
from course_lib.weights.checkpoint.safetensors_format import CheckpointError, safetensors_dtype
from course_lib.weights.transports import dist, ipc, sparse

REPO = Path(__file__).resolve().parents[1]
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


# ---- dtypes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("value,want", [
    (torch.bfloat16, torch.bfloat16), ("bfloat16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16),
    ("float32", torch.float32), ("int8", torch.int8), ("uint8", torch.uint8), ("bool", torch.bool),
    ("float8_e4m3fn", torch.float8_e4m3fn), ("float", torch.float32), ("half", torch.float16),
])
def test_parse_dtype_accepts_a_dtype_or_its_name(value, want):
    assert parse_dtype(value) is want


@pytest.mark.parametrize("value", ["Tensor", "nn", "_C", "torch.Tensor", "torch.nn", "float33", "Float32",
                                   "torch.torch.float32", " float32", "", None, 4, 1.5, ["float32"], torch.zeros(1)])
def test_parse_dtype_refuses_anything_that_is_not_a_dtype_and_names_it(value):
    with pytest.raises(DtypeError) as err:
        parse_dtype(value)
    assert isinstance(err.value, ValueError)
    assert repr(value) in str(err.value) and "is not a torch dtype" in str(err.value)


def test_parse_dtype_with_allowed_names_the_choices():
    assert parse_dtype("torch.float16", allowed=FLOATS) is torch.float16
    assert parse_dtype(torch.bfloat16, allowed=["float32", "bfloat16"]) is torch.bfloat16
    with pytest.raises(DtypeError, match=r"dtype 'int8' is not allowed here; choose one of float32, float16, bfloat16"):
        parse_dtype("int8", allowed=FLOATS)
    with pytest.raises(DtypeError, match=r"dtype 'nn' is not a torch dtype; choose one of float32, bfloat16"):
        parse_dtype("nn", allowed=["float32", "bfloat16"])


def test_dtype_name_is_the_payload_spelling_and_round_trips_every_dtype():
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_name("torch.float16") == "float16" and dtype_name("half") == "float16"
    every = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    assert len(every) > 20
    for d in every:
        assert parse_dtype(dtype_name(d)) is d and parse_dtype(str(d)) is d
    with pytest.raises(DtypeError, match="'Tensor'"):
        dtype_name("Tensor")


def test_parse_dtypes_names_the_position_of_a_bad_one():
    assert parse_dtypes(["float32", "torch.int64", torch.bool]) == [torch.float32, torch.int64, torch.bool]
    assert parse_dtypes([]) == []
    with pytest.raises(DtypeError, match=r"dtypes\[2\]: dtype 'Tensor' is not a torch dtype"):
        parse_dtypes(["float32", "bfloat16", "Tensor", "float16"])
    with pytest.raises(DtypeError, match=r"dtypes\[0\]: dtype 'int8' is not allowed here"):
        parse_dtypes(["int8"], allowed=FLOATS)
    with pytest.raises(DtypeError, match="single value 'float32'"):  # not parsed letter by letter
        parse_dtypes("float32")


def test_safetensors_codes():
    assert parse_safetensors_dtype("BF16") is torch.bfloat16 and parse_safetensors_dtype("F8_E4M3") is torch.float8_e4m3fn
    for code in ("bf16", "F4", "bfloat16", None, ["F32"]):
        with pytest.raises(DtypeError, match=re.escape(repr(code))):
            parse_safetensors_dtype(code)
    with pytest.raises(CheckpointError, match="model.safetensors: unsupported tensor dtype F4"):
        safetensors_dtype("F4", "model.safetensors")


def test_each_call_site_keeps_its_own_error_type_and_words():
    with pytest.raises(ConfigError, match=r"torch_dtype 'int8' is not one of \['bfloat16', 'float16', 'float32'\]"):
        ModelConfig(torch_dtype="int8")
    with pytest.raises(ConfigError, match="torch_dtype 'Tensor'"):
        ModelConfig(torch_dtype="Tensor")
    assert ModelConfig(torch_dtype="torch.bfloat16").torch_dtype == "bfloat16"  # config.json's spelling
    assert ModelConfig(torch_dtype=torch.float16).dtype is torch.float16
    assert resolve_dtype("torch.float16", "cpu", torch.float32) is torch.float16
    for bad in ("float64", "Tensor", "floa32"):  # a misspelt dtype is refused, not ignored
        with pytest.raises(ConfigError, match=f"dtype must be float32, float16 or bfloat16, got '{bad}'"):
            resolve_dtype(bad, "cpu", torch.float32)
    payload = {"names": ["w"], "shapes": [[2]], "dtypes": ["Tensor"],
               "indices": [torch.tensor([0])], "values": [torch.zeros(1)]}
    with pytest.raises(sparse.SparsePayloadError, match="w: dtype 'Tensor', expected a floating-point"):
        sparse.validate(payload, {"w": (2,)})
    payload["dtypes"] = ["torch.float32"]
    assert sparse.validate(payload, {"w": (2,)}) == [("w", (2,), torch.float32)]
    req = DistributedUpdateRequest(names=["a", "b"], dtypes=["bfloat16", "nn"], shapes=[[2], [3]])
    with pytest.raises(ApiError, match=r"dtypes\[1\]: 'nn' is not a torch dtype") as err:
        check_announced_tensors(req)
    assert err.value.status == 400
    group = [("a", torch.zeros(2, dtype=torch.bfloat16)), ("b", torch.zeros(1, dtype=torch.int64))]
    assert dist.describe(group)["dtypes"] == ["bfloat16", "int64"]


# ---- align_up ----------------------------------------------------------------------------------

def test_align_up():
    assert [bucket.align_up(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 16, 16, 16, 32, 32, 48]
    assert bucket.align_up(5, 4) == 8 and bucket.align_up(8, 4) == 8 and bucket.align_up(7, 1) == 7


def test_align_up_is_where_pack_starts_each_tensor():
    pairs = [("a", torch.zeros(3, dtype=torch.uint8)), ("b", torch.zeros(5)), ("c", torch.zeros(0)),
             ("d", torch.zeros(1, dtype=torch.float16)), ("e", torch.zeros(2, dtype=torch.int64))]
    meta = bucket.pack(pairs)["metadata"]
    for prev, m in zip(meta, meta[1:]):
        assert m.start_idx == bucket.align_up(prev.end_idx), (prev, m)


# ---- the bucket grouper ------------------------------------------------------------------------

def quadratic_bucket_plan(named_tensors, bucket_bytes):
    """The grouper as it was written before (``dist.bucket_plan``): the whole group re-measured per tensor."""
    plan, group = [], []
    for name, t in named_tensors:
        if group and bucket.bucket_nbytes(group + [(name, t)]) > bucket_bytes:
            plan.append(group)
            group = []
        group.append((name, t))
    if group:
        plan.append(group)
    return plan


GROUP_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int64, torch.bool)


def random_tensors(r, n):
    """(name, meta tensor) pairs: any dtype, 0 to 100 elements (meta: sizes without memory)."""
    return [(f"w{i}", torch.empty(r.choice([0, 1, 3, r.randint(0, 100)]), dtype=r.choice(GROUP_DTYPES),
                                  device="meta")) for i in range(n)]


def names(groups):
    return [[n for n, _ in g] for g in groups]


@pytest.mark.parametrize("case", range(40))
def test_grouper_equals_the_quadratic_plan_on_random_inputs(case):
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    r = random.Random(seed)
    pairs = random_tensors(r, r.randint(0, 60))
    bucket_bytes = r.choice([1, 16, 40, 100, 256, 333, 1000, 1 << 20])
    want = names(quadratic_bucket_plan(pairs, bucket_bytes))
    assert names(bucket.group_into_buckets(pairs, bucket_bytes)) == want, f"seed {seed}"
    assert names(dist.bucket_plan(pairs, bucket_bytes)) == want, f"seed {seed}"
    assert names(ipc.group_into_buckets(iter(pairs), bucket_bytes)) == want, f"seed {seed}"


def test_each_group_fits_what_pack_allocates_and_the_next_tensor_would_not():
    """The size the grouper assumes is what ``pack`` really allocates: each group packs into
    at most ``bucket_bytes`` (or is one tensor), and adding the next tensor would not fit."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    r = random.Random(seed)
    pairs = [(f"w{i}", torch.zeros(r.randint(0, 40), dtype=r.choice(GROUP_DTYPES))) for i in range(300)]
    bucket_bytes = r.choice([48, 100, 200, 517])
    groups = list(bucket.group_into_buckets(pairs, bucket_bytes))
    assert [p for g in groups for p in g] == pairs, f"seed {seed}: every tensor once, in order"
    at = 0
    for g in groups:
        at += len(g)
        packed = bucket.pack(g)["flattened_tensor"].numel()
        assert packed <= bucket_bytes or len(g) == 1, f"seed {seed}: {len(g)} tensors pack into {packed} bytes"
        if at < len(pairs):
            more = bucket.pack(g + [pairs[at]])["flattened_tensor"].numel()
            assert more > bucket_bytes, f"seed {seed}: the next tensor would still have fitted ({more} bytes)"


def test_grouper_padding_and_oversized_tensors():
    three = ("a", torch.zeros(3, dtype=torch.uint8))
    sixteen = ("b", torch.zeros(4))
    # 3 bytes, padding to 16, then 16 bytes: 32 bytes packed, so 31 splits them and 32 does not
    assert names(bucket.group_into_buckets([three, sixteen], 32)) == [["a", "b"]]
    assert names(bucket.group_into_buckets([three, sixteen], 31)) == [["a"], ["b"]]
    # no padding after the last tensor: 16 + 3 bytes fit 19
    assert names(bucket.group_into_buckets([sixteen, three], 19)) == [["b", "a"]]
    big = ("big", torch.zeros(100))
    assert names(bucket.group_into_buckets([three, big, three], 64)) == [["a"], ["big"], ["a"]]
    assert list(bucket.group_into_buckets([], 64)) == []


def test_grouper_is_lazy():
    """A sender streaming its tensors (from disk, say) holds one group at a time."""
    taken = []

    def stream():
        for i in range(100):
            taken.append(i)
            yield f"w{i}", torch.zeros(4)  # 16 bytes: four per 64-byte bucket
    groups = ipc.group_into_buckets(stream(), 64)
    assert len(next(groups)) == 4 and len(taken) == 5  # the fifth showed the first group full


def test_grouper_is_linear():
    """20,000 tiny tensors in one bucket (the quadratic plan's worst case: ~2e8 re-measured
    entries) group in well under a second."""
    pairs = [(f"w{i}", torch.empty(1, device="meta")) for i in range(20_000)]
    start = time.perf_counter()
    groups = list(bucket.group_into_buckets(pairs, 1 << 30))
    took = time.perf_counter() - start
    assert len(groups) == 1 and len(groups[0]) == 20_000
    assert took < 1.0, f"grouping 20,000 tensors took {took:.2f} s"


# ---- settings ----------------------------------------------------------------------------------

VARIABLES = ("COURSE_LIB_API_KEY", "COURSE_LIB_READ_THREADS", "COURSE_LIB_READ_CHUNK_MB", "COURSE_LIB_PINNED_READER",
             "COURSE_LIB_COPY_PLAN", "COURSE_LIB_DIRECT_QUANT", "COURSE_LIB_REGISTERED_COPY",
             "COURSE_LIB_GROUP_CONNECT_TIMEOUT_S", "COURSE_LIB_MAX_STORAGE_BYTES", "COURSE_LIB_FUSED_KERNELS",
             "COURSE_LIB_DISK_READER")


@pytest.fixture
def clean_env(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_settings_defaults(clean_env):
    assert settings.api_key() is None
    assert settings.read_threads() == min(16, os.cpu_count() or 1)
    assert settings.read_chunk_bytes() == 64 << 20
    assert settings.pinned_reader() and settings.copy_plan() and settings.direct_quant()
    assert settings.registered_copy() is None
    assert settings.group_connect_timeout_s() == 30.0 == dist.connect_timeout_s()
    assert settings.max_storage_bytes() == 64 << 30
    assert settings.fused_kernels() == "on"
    assert settings.disk_reader() == "own"


def test_settings_are_read_when_called(clean_env):
    env = {"COURSE_LIB_API_KEY": "k3y", "COURSE_LIB_READ_THREADS": "3", "COURSE_LIB_READ_CHUNK_MB": "2",
           "COURSE_LIB_REGISTERED_COPY": "foreach", "COURSE_LIB_GROUP_CONNECT_TIMEOUT_S": "2.5",
           "COURSE_LIB_MAX_STORAGE_BYTES": "1000", "COURSE_LIB_FUSED_KERNELS": "interpret"}
    for name, value in env.items():
        clean_env.setenv(name, value)
    assert settings.api_key() == "k3y" and settings.read_threads() == 3 and settings.read_chunk_bytes() == 2 << 20
    assert settings.registered_copy() == "foreach" and settings.max_storage_bytes() == 1000
    assert settings.group_connect_timeout_s() == 2.5 == dist.connect_timeout_s()
    assert settings.fused_kernels() == "interpret"
    clean_env.setenv("COURSE_LIB_FUSED_KERNELS", "0")
    assert settings.fused_kernels() == "off"
    clean_env.setenv("COURSE_LIB_READ_THREADS", "0")  # 0: the default
    assert settings.read_threads() == min(16, os.cpu_count() or 1)


@pytest.mark.parametrize("name,function", [("COURSE_LIB_PINNED_READER", settings.pinned_reader),
                                           ("COURSE_LIB_COPY_PLAN", settings.copy_plan),
                                           ("COURSE_LIB_DIRECT_QUANT", settings.direct_quant)])
def test_switches_are_off_only_at_0(clean_env, name, function):
    clean_env.setenv(name, "0")
    assert function() is False
    for on in ("1", "yes", "false", ""):  # anything but "0" leaves the fast path on, as before
        clean_env.setenv(name, on)
        assert function() is True, on


def test_empty_means_unset(clean_env):
    for name in VARIABLES:
        clean_env.setenv(name, "")
    test_settings_defaults(clean_env)


@pytest.mark.parametrize("name,value,words", [
    ("COURSE_LIB_READ_THREADS", "many", "is not an integer"), ("COURSE_LIB_READ_THREADS", "-1", "at least 0"),
    ("COURSE_LIB_READ_CHUNK_MB", "0", "at least 1"), ("COURSE_LIB_READ_CHUNK_MB", "1.5", "is not an integer"),
    ("COURSE_LIB_GROUP_CONNECT_TIMEOUT_S", "soon", "is not a number"),
    ("COURSE_LIB_GROUP_CONNECT_TIMEOUT_S", "0", "above 0"), ("COURSE_LIB_GROUP_CONNECT_TIMEOUT_S", "nan", "at least"),
    ("COURSE_LIB_MAX_STORAGE_BYTES", "64e9", "is not an integer"), ("COURSE_LIB_MAX_STORAGE_BYTES", "-5", "at least 0"),
    ("COURSE_LIB_FUSED_KERNELS", "yes", "use 0, 1 or interpret"),
])
def test_unusable_values_are_refused_naming_the_variable(clean_env, name, value, words):
    clean_env.setenv(name, value)
    function = {"COURSE_LIB_READ_THREADS": settings.read_threads, "COURSE_LIB_READ_CHUNK_MB": settings.read_chunk_bytes,
                "COURSE_LIB_GROUP_CONNECT_TIMEOUT_S": settings.group_connect_timeout_s,
                "COURSE_LIB_MAX_STORAGE_BYTES": settings.max_storage_bytes,
                "COURSE_LIB_FUSED_KERNELS": settings.fused_kernels}[name]
    with pytest.raises(settings.SettingsError, match=re.escape(name)) as err:
        function()
    assert words in str(err.value) and isinstance(err.value, ValueError)


def test_import_time_constants_go_through_settings():
    """pinned_reader's and safe_pickle's constants are read once, at import, from settings."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COURSE_LIB_READ_CHUNK_MB": "3", "COURSE_LIB_READ_THREADS": "5",
           "COURSE_LIB_MAX_STORAGE_BYTES": "12345"}
    code = ("from course_lib.weights.checkpoint import pinned_reader as p\nfrom course_lib.weights.transports import safe_pickle as s\n"
            "print(p.CHUNK_BYTES, p.READ_THREADS, s.MAX_STORAGE_BYTES)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(3 << 20), "5", "12345"]


# Every COURSE_LIB_ variable is read through settings.py; no other module may read one.
READS_ELSEWHERE: set[str] = set()


def test_settings_table_lists_every_variable_and_only_settings_reads_them():
    doc_vars = set(re.findall(r"^\| ``(COURSE_LIB_\w+)``", settings.__doc__, flags=re.M))
    assert doc_vars == set(VARIABLES), doc_vars ^ set(VARIABLES)
    source = (REPO / "course_lib" / "settings.py").read_text()
    assert all(f'"{name}"' in source for name in VARIABLES), "each variable the table lists is read"
    readers = []
    for path in sorted((REPO / "course_lib").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel != "course_lib/settings.py" and re.search(r"(environ|getenv)\W+[^\n]*COURSE_LIB_", path.read_text()):
            readers.append(rel)
    assert set(readers) <= READS_ELSEWHERE, f"read the environment through course_lib.settings: {readers}"
