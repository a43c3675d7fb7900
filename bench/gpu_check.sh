#!/usr/bin/env bash
# The prepared GPU check (issues 17 and 28): issue 28's real shapes in bf16 on one GPU. Qwen2.5-0.5B's and
# Qwen2.5-1.5B's full configs (random init, the real 151,936-entry vocabulary, tokenizer built locally), G=16,
# 512 completion tokens, every recorder on: native trainer vs TRL's GRPOTrainer, and TRL with vLLM colocate when
# vllm is importable (else recorded as skipped with the reason); peak GPU memory (torch.cuda.max_memory_allocated,
# per process) and s/step; then shift and displacement on the 0.5B native adapter. Results: $OUT/gpu_check.json
# and $OUT/benchmarks_snippet.md (date, GPU, the table with the native / TRL ratios) for docs/benchmarks.md.
#
# Time on one H200 (an estimate, not yet measured): both models built on the GPU ~1 min; each trainer case
# 40-80 s (a fresh process: imports, load, two held-out evals of 4 prompts x 512 tokens, 2 steps of 16 x 512);
# 5 trainer cases without vllm, 7 with it (+~60 s each for the engine's start); shift + displacement ~30 s:
# about 6-9 minutes. A budget (--budget-s, default 510 s) records any case that would start later as skipped,
# so the check fits one device call of 10 minutes (run it with timeout_s=600).
#
#   bash bench/gpu_check.sh              # on a GPU machine (the device tool sets $OUT)
#   bash bench/gpu_check.sh --dry-run    # the same sequence on the CPU at tiny shapes (tests/test_gpu_check.py)
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
