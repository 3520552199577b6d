#!/usr/bin/env bash
# LLaMA-Factory 0.9.5 in its own venv (default ../lf-venv), for the side-by-side benchmarks (sft.py, dpo.py,
# row_length.py read it from --lf-python / $LLAMAFACTORY_PYTHON). Never a dependency of erniekit-lite.
# Its requirements pull a CUDA torch 2.15 and CUDA builds of torchvision / torchaudio / torchcodec: torch goes back
# to the CPU 2.13.0 the main venv uses, and the other three are removed (text-only training never calls them; the
# runner stubs torchaudio, which LLaMA-Factory imports at module level).
set -euo pipefail
venv="${1:-$(cd "$(dirname "$0")/../.." && pwd)/lf-venv}"
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q llamafactory==0.9.5
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
"$venv/bin/python" -c "import torch, llamafactory; print('LLaMA-Factory', llamafactory.__version__, 'torch', torch.__version__)"
