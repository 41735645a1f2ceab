#!/usr/bin/env bash
# lm-evaluation-harness (pinned, in its own venv: LMEVAL_PY) against `specdec serve` with the default pair, once
# speculative (the default suffix drafter) and once plain (--drafter none), on a loglikelihood task (echo +
# logprobs) and a generation task. Usage: bash benchmarks/lm-eval/run.sh OUT_DIR [LIMIT]
set -euo pipefail
out=${1:?output directory}; limit=${2:-40}; port=${PORT:-8321}
py=${LMEVAL_PY:-/tmp/lmeval/bin/python}
# The default target's tokenizer as specdec saved it on first load (lm-eval counts the context's tokens with it).
tokenizer=${TOKENIZER:-$(ls -d ~/.cache/specdec/tokenizers/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M-* | head -1)}
mkdir -p "$out"
lscpu > "$out/lscpu.txt"
for mode in speculative plain; do
  extra=(); [ "$mode" = plain ] && extra=(--drafter none)
  specdec serve --port "$port" --threads 2 "${extra[@]}" > "$out/serve-$mode.log" 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  until [ "$(curl -s -o /dev/null -w '%{http_code}' "localhost:$port/health")" = 200 ]; do sleep 2; done
  model=$(curl -s "localhost:$port/v1/models" | python -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
  HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 "$py" -m lm_eval --model local-completions \
    --model_args "model=$model,base_url=http://127.0.0.1:$port/v1/completions,tokenizer_backend=huggingface,tokenizer=$tokenizer,num_concurrent=1,max_retries=1" \
    --include_path benchmarks/lm-eval/tasks --tasks specdec_arith_mc,specdec_arith_gen --limit "$limit" \
    --log_samples --output_path "$out/$mode" > "$out/lm-eval-$mode.log" 2>&1
  kill $server; wait $server 2>/dev/null || true
done
"$py" benchmarks/lm-eval/compare.py "$out"
