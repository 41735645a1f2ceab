#!/usr/bin/env bash
# Issue 18 on this 2-core machine: 2 replicas x 1 thread vs 1 replica x 1 thread vs `specdec serve --threads 2`
# at concurrency 4 on the 15 chat prompts (default pair, greedy, 128 tokens), then a kill -9 of one replica under
# 4 concurrent streams. Needs: pip install -e '.[ray,bench,default-models]'. Writes results.json and results.md
# beside this script (about 25 minutes: each system loads the default pair on its own).
set -euo pipefail
cd "$(dirname "$0")/../.."
python benchmarks/ray-2core/ray_bench.py both --concurrency 4 --max-tokens 128 \
    --tasks spec_bench,humaneval,code_edit --limit 1 --out benchmarks/ray-2core "$@"
