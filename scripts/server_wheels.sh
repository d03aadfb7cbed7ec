#!/usr/bin/env bash
# The HTTP server's packages as wheels for a GPU machine that has torch and httpx but not
# FastAPI, uvicorn, Starlette or pydantic, and cannot reach a package index. Run it here
# (it downloads into .whl/, git-ignored, and the folder travels with the working tree);
# then, on the GPU machine, from the repository root:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
# Versions are those installed on the development machine (pip show), for Python 3.12 on
# manylinux x86_64; each package's Requires-Dist is listed, so --no-deps misses nothing:
#   fastapi: starlette, anyio, pydantic, typing-extensions, typing-inspection, annotated-doc, opentelemetry-api
#   starlette: anyio, typing-extensions     uvicorn: click, h11       anyio: idna (sniffio for older callers)
#   pydantic: annotated-types, pydantic-core, typing-extensions, typing-inspection
#   opentelemetry-api, typing-inspection, pydantic-core: typing-extensions
# and the judge's differential hidden cases' one extra package: hypothesis (needs sortedcontainers);
# and InstantTensor, the loader `bench update` compares the disk path with (needs torch only);
# and the mutation tool `judge.py mutate` takes its operators from: cosmic-ray (its operators
# need only parso and attrs, all three pure Python; the rest of its requirements serve its own
# runner and command line, which the judge does not use)
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.13.4 pydantic-core==2.46.4
    annotated-types==0.7.0 typing-inspection==0.4.2 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1 click==8.5.1
    typing-extensions==4.16.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2 idna==3.20
    hypothesis==6.155.2 sortedcontainers==2.4.0
    instanttensor==0.2.2
    cosmic-ray==8.7.0 parso==0.8.7 attrs==26.1.0
)
mkdir -p .whl
for spec in "${PACKAGES[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$spec"
done
ls .whl
du -sh .whl
