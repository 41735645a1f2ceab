#!/usr/bin/env bash
# The GPU checks and bench in one call (a lent H200 gives 15 minutes, start-up included):
#   1. the tests marked gpu (CUDA graphs vs transformers' forward and eager greedy in fp32, sampling on CUDA);
#   2. the GPU bench, dummy Qwen2.5-7B target + 0.5B draft, bf16: our methods and transformers' (eager, static
#      cache + torch.compile, assisted, prompt lookup) interleaved;
#   3. if time is left, the 1.5B target with the same draft.
# Usage, from the repository root: OUT=<folder> bash benchmarks/gpu-h200/run.sh   (PYTHONPATH=src: no install)
set -uo pipefail
OUT=${OUT:-bench-results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
SPECDEC="python3 -m specdec.cli"
DUMMY="bench --load-format dummy --device cuda --prompt-tokens 300 --max-tokens 128"
{ nvidia-smi; python3 -c "import torch, transformers, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"; } > "$OUT/env.txt" 2>&1
grep -E "H200|H100|torch" "$OUT/env.txt"
echo "== gpu tests ($(elapsed) s)"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_static_decoder.py tests/test_verify.py > "$OUT/gpu-tests.txt" 2>&1
echo "rc=$?"; grep -E "^(E  |FAILED)|passed|failed" "$OUT/gpu-tests.txt" | head -30
echo "== bench 7B ($(elapsed) s)"
timeout 300 $SPECDEC $DUMMY --dummy-target qwen2.5-7b --dummy-draft qwen2.5-0.5b --num-prompts 4 --time-budget 170 \
  --gpu-methods plain,replay_k8,lookup_adaptive,draft_k4,draft_adaptive,hf_eager,hf_assisted_k4,hf_prompt_lookup,hf_static \
  --out "$OUT/qwen2.5-7b" > "$OUT/bench-7b.log" 2>&1
echo "rc=$?"; sed -n '9,20p' "$OUT/qwen2.5-7b/results.md" 2>/dev/null
grep -A60 "Pass cost of the target" "$OUT/qwen2.5-7b/results.md" 2>/dev/null | grep -E "^\| (ms|x)|kernels|compile|: "; tail -6 "$OUT/bench-7b.log"
if [ "$(elapsed)" -lt ${SMALL_BEFORE:-340} ]; then
  echo "== bench 1.5B ($(elapsed) s)"
  timeout $(( ${END_BY:-480} - $(elapsed) )) $SPECDEC $DUMMY --dummy-target qwen2.5-1.5b --dummy-draft qwen2.5-0.5b \
    --num-prompts 2 --gpu-methods plain,replay_k8,lookup_adaptive,draft_adaptive,hf_eager --out "$OUT/qwen2.5-1.5b" \
    > "$OUT/bench-1.5b.log" 2>&1
  echo "rc=$?"; sed -n '9,16p' "$OUT/qwen2.5-1.5b/results.md" 2>/dev/null; grep -E "cost_ratio|one_row|compile" "$OUT/qwen2.5-1.5b/results.md"; tail -3 "$OUT/bench-1.5b.log"
fi
echo "== done ($(elapsed) s)"
