#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.py needs on the GPU machine, whose image has torch 2.11 (cu130), transformers 5.17,
# accelerate 1.15 and peft but no trl, datasets, pydantic or bitsandbytes, and no network. Downloaded here into .whl/
# (ignored by git) for Python 3.12 on x86-64, without dependencies: each missing one is named (datasets' pyarrow,
# pandas, xxhash and huggingface_hub are in the image). transformers and peft are carried at the versions
# erniekit-lite is tested with; typing_extensions, fsspec and regex at the versions datasets, pydantic and
# transformers 5.23 ask for, in case the image's are older. bitsandbytes ships a library for every CUDA and ROCm
# version (43 MB); only its CPU and CUDA 13 libraries are kept (its RECORD rewritten to match): the image's torch is
# cu130. About 25 MiB; with the repository and gpu-assets/ a call carries under 30 of its 64 MiB.
# See docs/performance.md ("On a GPU") for the run command.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d .whl \
    trl==1.16.0 datasets==5.2.0 transformers==5.23.0 peft==0.21.2 bitsandbytes==0.50.2 \
    pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
    dill==0.4.1 multiprocess==0.70.19 typing-extensions==4.16.0 fsspec==2026.9.0 regex==2026.11.15
python3 - .whl/bitsandbytes-*.whl <<'EOF'
import re, sys, zipfile
path = sys.argv[1]
keep = lambda name: not re.search(r"libbitsandbytes_(?!cpu|cuda13)\w+\.so$", name)
with zipfile.ZipFile(path) as src:
    items = [(info, src.read(info)) for info in src.infolist() if keep(info.filename)]
with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as dst:
    for info, data in items:
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(True) if keep(line.split(b",")[0].decode()))
        dst.writestr(info, data)
EOF
# What a device call carries: tracked files, untracked files git does not ignore, .whl/ and gpu-assets/ (the limit is
# 64 MiB = 67,108,864 bytes)
tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 du -cb 2>/dev/null | awk '/\ttotal$/ {s += $1} END {print s}')
total=$(( tree + $(du -sb .whl | cut -f1) + $( [ -d gpu-assets ] && du -sb gpu-assets | cut -f1 || echo 0) ))
echo ".whl: $(ls .whl | wc -l) wheels, $(du -sb .whl | cut -f1) bytes; carried in all: ${total} bytes (limit 67108864)"
[ "$total" -le 67108864 ] || echo "over the limit: see what else the working tree holds (git status)" >&2
