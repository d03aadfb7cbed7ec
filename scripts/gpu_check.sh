#!/usr/bin/env bash
# On the GPU machine: every cuda-marked test, then the GPU benchmarks, in one call.
#   bash scripts/gpu_check.sh            (logs and JSON under $OUT, or gpu-latest/)
# Runs from the repository root without installing anything (torch, safetensors,
# transformers and pytest are already there).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-latest}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"
status=0
python -m pytest -m cuda -p no:cacheprovider -q -rA --continue-on-collection-errors 2>&1 | tee "$out/pytest_cuda.log" || status=1
# The judge's CUDA cases (graded here, "not graded" on CPU machines).
python practice/judge.py check 2>&1 | tee "$out/judge_check.log" || status=1
python -m course_lib.bench decode --preset qwen3-0.6b --batch 1 8 --json "$out/decode_qwen3-0.6b.json" || status=1
python -m course_lib.bench decode --preset qwen3-8b --batch 1 8 --json "$out/decode_qwen3-8b.json" || status=1
exit $status
