#!/usr/bin/env bash
# One-command set-up: the package with every extra, and a CPU-sized torch where no GPU is.
# torch is pinned here because a bare "torch" requirement can pull a multi-GB CUDA build
# onto a CPU-only machine. On a GPU machine, keep the torch you have (any >= 2.4 works).
set -euo pipefail
cd "$(dirname "$0")/.."
if python -c "import torch" 2>/dev/null; then
    torch_req=""  # already installed (GPU machines bring their own CUDA build)
else
    torch_req="torch==2.13.0"
fi
python -m pip install $torch_req -e ".[dev]"
