#!/usr/bin/env bash
# The GPU checks and bench in one call (a lent H200 gives 15 minutes, start-up included):
#   1. the tests marked gpu (CUDA graphs vs transformers' forward and eager greedy in fp32, sampling on CUDA);
#   2. the GPU bench, dummy Qwen2.5-7B target + 0.5B draft, bf16, our methods and transformers' eager peers;
#   3. transformers' static cache + torch.compile beside plain decoding (its compile takes minutes);
#   4. if time is left, the 1.5B target with the same draft.
# Usage, from the repository root: OUT=<folder> bash benchmarks/gpu-h200/run.sh   (PYTHONPATH=src: no install)
set -uo pipefail
OUT=${OUT:-bench-results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
specdec() { python3 -c "import sys; from specdec.cli import main; sys.exit(main())" "$@"; }
DUMMY="bench --load-format dummy --device cuda --prompt-tokens 300 --max-tokens 128"
{ nvidia-smi; python3 -c "import torch, transformers, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"; } 2>&1 | tee "$OUT/env.txt" | grep -E "H200|H100|torch|Driver"
echo "== gpu tests ($(elapsed) s)"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_static_decoder.py tests/test_verify.py > "$OUT/gpu-tests.txt" 2>&1
echo "rc=$?"; grep -E "^(E  |FAILED)|passed|failed" "$OUT/gpu-tests.txt" | head -30
echo "== bench 7B ($(elapsed) s)"
timeout 200 specdec $DUMMY --dummy-target qwen2.5-7b --dummy-draft qwen2.5-0.5b --num-prompts 4 \
  --gpu-methods plain,replay_k8,lookup_adaptive,draft_k4,draft_adaptive,hf_eager,hf_assisted_k4,hf_prompt_lookup \
  --time-budget 130 --out "$OUT/qwen2.5-7b" > /tmp/bench-7b.log 2>&1
echo "rc=$?"; sed -n '9,20p' "$OUT/qwen2.5-7b/results.md" 2>/dev/null; grep -A30 "Pass cost of the target" "$OUT/qwen2.5-7b/results.md" 2>/dev/null | grep -E "^\| (ms|x)|kernels|: "; tail -8 /tmp/bench-7b.log
if [ "$(elapsed)" -lt ${HF_STATIC_BEFORE:-220} ]; then
  echo "== transformers static+compile, 7B ($(elapsed) s)"
  timeout $(( ${END_BY:-330} - $(elapsed) )) specdec $DUMMY --dummy-target qwen2.5-7b --dummy-draft none --num-prompts 2 \
    --gpu-methods plain,hf_eager,hf_static --out "$OUT/qwen2.5-7b-hf-static" > /tmp/bench-7b-hf-static.log 2>&1
  echo "rc=$?"; sed -n '9,14p' "$OUT/qwen2.5-7b-hf-static/results.md" 2>/dev/null; tail -3 /tmp/bench-7b-hf-static.log
fi
if [ "$(elapsed)" -lt ${SMALL_BEFORE:-260} ]; then
  echo "== bench 1.5B ($(elapsed) s)"
  timeout $(( ${END_BY:-330} - $(elapsed) )) specdec $DUMMY --dummy-target qwen2.5-1.5b --dummy-draft qwen2.5-0.5b --num-prompts 2 \
    --gpu-methods plain,replay_k8,lookup_adaptive,draft_adaptive,hf_eager --out "$OUT/qwen2.5-1.5b" > /tmp/bench-1.5b.log 2>&1
  echo "rc=$?"; sed -n '9,16p' "$OUT/qwen2.5-1.5b/results.md" 2>/dev/null; tail -3 /tmp/bench-1.5b.log
fi
echo "== done ($(elapsed) s)"
