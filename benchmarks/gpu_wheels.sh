#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.py needs on the GPU machine, whose image has torch 2.11, transformers 5.17,
# accelerate and peft but no trl, datasets, pydantic or bitsandbytes, and no network. Downloaded here into .whl/
# (ignored by git) for Python 3.12 on x86-64, without dependencies: each missing one is named. About 59 MiB;
# with the repository and gpu-assets/ the call carries under 64 MiB. transformers and peft are carried at the
# versions erniekit-lite is tested with. See README "On a GPU" for the run command.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d .whl \
    trl==1.16.0 datasets==5.2.0 transformers==5.23.0 peft==0.21.2 bitsandbytes==0.50.2 \
    pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
    dill==0.4.1 multiprocess==0.70.19
# What a device call carries: tracked files, .whl/ and gpu-assets/ (the limit is 64 MiB = 67,108,864 bytes)
total=$(( $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) + $(du -sb .whl | cut -f1) + $( [ -d gpu-assets ] && du -sb gpu-assets | cut -f1 || echo 0) ))
echo "carried: ${total} bytes (limit 67108864)"
[ "$total" -le 67108864 ] || echo "over the limit: carry .whl without bitsandbytes and run gpu_check.py --only attention,sft,dpo,moe,fsdp2" >&2
