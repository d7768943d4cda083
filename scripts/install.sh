#!/usr/bin/env bash
# One-step set-up: a virtualenv in .venv holding specsample with its server, benchmark and test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
. .venv/bin/activate
python -m pip install -q --disable-pip-version-check --upgrade pip
# torch first: the pin is the fast CPU path on our machines; a CUDA user installs their own torch
# beforehand (or sets TORCH_SPEC), and an importable torch is left alone.
python -c "import torch" 2>/dev/null || python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
python -m pip install -q -e ".[serve,bench,test,ray]"
# llama.cpp, a benchmark peer, is left out: it compiles for minutes, with flags of its own (docs/benchmarks.md)
# our int4/int8 CPU kernels, built for this machine now rather than on first use (skipped, with the reason
# logged, where the CPU lacks AVX512-BF16 or there is no C++ compiler: torch's kernels are used instead)
python -c "from specsample.models import row_kernels; row_kernels.available()"
