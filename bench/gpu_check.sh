#!/usr/bin/env bash
# The prepared GPU check (issue 17): native trainer and TRL on the 0.5B-shaped model in bf16 (a few steps each,
# G=8), plus shift and displacement, on one GPU. Results: $OUT/gpu_check.json and $OUT/benchmarks_snippet.md
# (date, GPU, s/step, completion tokens/s, peak GPU memory) to paste into docs/benchmarks.md.
#
#   bash bench/gpu_check.sh              # on a GPU machine (the device tool sets $OUT)
#   bash bench/gpu_check.sh --dry-run    # CPU smoke run of the same sequence on the bundled model
#
# PYTHON picks the interpreter (default: python3); it needs torch with CUDA, transformers, peft, trl and mechdiag's
# own dependencies (pip install -e . on the machine first if they are missing).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
if [[ "${1:-}" != "--dry-run" ]]; then
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv \
    | tee "$OUT/nvidia-smi.txt" || true
fi
"$PYTHON" -c "import torch, transformers, peft, trl; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" \
  || { echo "gpu_check: $PYTHON lacks torch/transformers/peft/trl" >&2; exit 2; }
set -o pipefail
"$PYTHON" bench/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
