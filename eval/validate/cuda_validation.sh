#!/usr/bin/env bash
# The simulator's validation on a GPU (docs/SIMULATOR.md, Validation): the quick closed-loop curve run for
# real by the local engine on CUDA, on a random-weight family of real layer shapes (timing does not depend on
# the weights), then simulated on cost models fitted to the steps it measured; errors per system and rate.
#
# Made for a lent device machine (one short call; nothing there can be downloaded, so the trace is the saved
# quick trace of seed 0 and the family's weights are drawn by the engine at load):
#   run(command="bash eval/validate/cuda_validation.sh", timeout_s=560)
# Knobs (environment): PRESET (build_scripts/random_family.py), RATES, DTYPE, KV_PAGES, PAGE_BYTES, PYTHON.
# Writes $OUT/validation_cuda.json and $OUT/validation_cuda.log (OUT defaults to ./cuda_validation_out).
# CHECKS (default "validation speculation") picks the parts. `speculation`: draft-target speculation on the local
# engine with the shipped tiny family (eval/simulate/measure_speculation.py): per-token acceptance of each member
# pair at temperature 0 and 1, draft / verify step costs for k in SPEC_COST_K at batch SPEC_COST_BATCH, and the
# step with the drafter's own batch riding in the drafts' catch-up forward against apart (speculation.drafts_ride);
# prints a small table, writes $OUT/speculation_cuda.json. It runs first and takes about a minute, so its JSON comes back
# even when the validation runs past the call's limit; alone:
#   run(command="CHECKS=speculation bash eval/validate/cuda_validation.sh", timeout_s=240)
# Knobs: SPEC_PROMPTS, SPEC_TOKENS, SPEC_COST_K, SPEC_COST_BATCH, SPEC_DTYPE.
# On a machine without CUDA it says so and stops (exit 3), unless ALLOW_CPU=1 (the pipeline check the test
# suite's author runs on a CPU with PRESET=tiny).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$PWD/cuda_validation_out}
PY=${PYTHON:-python3}
PRESET=${PRESET:-llama3.2-1b-nested}
RATES=${RATES:-0.5,1,4}
DTYPE=${DTYPE:-bfloat16}
# 32 KiB pages hold 16 tokens of one layer of Llama-3.2-1B's K and V in bf16; 1,024 of them hold ~1,000 tokens
# of the 16-layer member: the same pressure as the CPU quick bench's 512 pages on tiny-l
PAGE_BYTES=${PAGE_BYTES:-32768}
KV_PAGES=${KV_PAGES:-1024}
CHECKS=${CHECKS:-validation speculation}
SPEC_PROMPTS=${SPEC_PROMPTS:-4}
SPEC_TOKENS=${SPEC_TOKENS:-32}
SPEC_COST_K=${SPEC_COST_K:-1,2,3,4}
SPEC_COST_BATCH=${SPEC_COST_BATCH:-1,4,16}
SPEC_DTYPE=${SPEC_DTYPE:-float32}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  git rev-parse HEAD 2>/dev/null || true
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" - <<'EOF'
import os, sys, torch
cuda = torch.cuda.is_available()
print(f"python {sys.version.split()[0]} torch {torch.__version__} cuda {cuda}"
      + (f" device {torch.cuda.get_device_name()}" if cuda else ""))
if not cuda and os.environ.get("ALLOW_CPU") != "1":
    print("cuda_validation: no CUDA device here (set ALLOW_CPU=1 to check the pipeline on a CPU)")
    sys.exit(3)
EOF
  DEVICE=$("$PY" -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
  if [[ " $CHECKS " == *" speculation "* ]]; then
    "$PY" -m eval.simulate.measure_speculation --family tiny --device "$DEVICE" --dtype "$SPEC_DTYPE" --costs \
        --prompts "$SPEC_PROMPTS" --new-tokens "$SPEC_TOKENS" --cost-k "$SPEC_COST_K" \
        --cost-batch "$SPEC_COST_BATCH" --out "$OUT/speculation_cuda.json"
  fi
  if [[ " $CHECKS " == *" validation "* ]]; then
    "$PY" -m build_scripts.random_family --preset "$PRESET" --out "$WORK/family" --force
    "$PY" -m eval.validate.bench_vs_sim --quick --trace eval/simulate/data/quick_trace_seed0.json \
        --family "$WORK/family" --rates "$RATES" --kv-pages "$KV_PAGES" \
        --set pool.page_bytes="$PAGE_BYTES" --set engine.dtype="$DTYPE" --set escalation.enabled=false \
        --work-dir "$WORK/val" --out "$OUT/validation_cuda.json"
  fi
} 2>&1 | tee "$OUT/validation_cuda.log"     # pipefail: the group's exit status is the script's
