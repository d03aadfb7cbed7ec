"""GPU: CUDA-graph decode equals eager decode, and the GPU engine agrees with the CPU engine."""
import pytest
import torch

from course_lib import Engine
from course_lib.testing import prompt_logits

pytestmark = pytest.mark.cuda
PROMPTS = ["graphs", "CUDA graphs remember addresses", "x" * 70, "decode buckets", "a", "b", "c", "d", "e"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_decode_equals_eager(make_ckpt, dtype):
    ckpt = make_ckpt("small", seed=3)
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    eager = Engine(ckpt, device="cuda", dtype=dtype, enable_cuda_graph=False).generate(PROMPTS, params)
    graph_engine = Engine(ckpt, device="cuda", dtype=dtype, enable_cuda_graph=True)
    assert graph_engine.model_runner.graphs, "no CUDA graph was captured"
    graphed = graph_engine.generate(PROMPTS, params)
    assert [o["output_ids"] for o in graphed] == [o["output_ids"] for o in eager]


def test_gpu_logits_match_cpu(make_ckpt):
    ckpt = make_ckpt("small", seed=4)
    ids = list(range(3, 60))
    cpu = prompt_logits(Engine(ckpt), ids)
    gpu = prompt_logits(Engine(ckpt, device="cuda", dtype="float32"), ids)
    assert ((gpu - cpu).norm() / cpu.norm()).item() < 1e-3  # TF32 or reduction order, no more
