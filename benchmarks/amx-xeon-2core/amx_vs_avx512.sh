#!/usr/bin/env bash
# llama-bench over the AMX and the non-AMX (AVX-512/VNNI, repacked) builds of the same llama.cpp, interleaved
# per thread count: ms per pass of n rows for the default target (pp n = one pass of n rows).
#   bash amx_vs_avx512.sh OUT_DIR   (builds from ../shared/peers/build-llamacpp.sh, PEER_AMX=1 and 0)
set -euo pipefail
out=${1:-.}
cache="${SPECDEC_CACHE:-$HOME/.cache/specdec}"
model="$cache/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf"
amx=$(ls -d "$cache"/llama.cpp-0.3.36-*amx1/bin) noamx=$(ls -d "$cache"/llama.cpp-0.3.36-*amx0/bin)
for threads in 2 1; do
  for round in 1 2; do
    for build in amx noamx; do
      bin=$amx; [ $build = noamx ] && bin=$noamx
      "$bin/llama-bench" -m "$model" -t "$threads" -p 1,2,3,4,5,8,9,16,17,32,33,64,512 -n 0 -r 3 -o json \
        > "$out/llama-bench-$build-t$threads-r$round.json" 2>/dev/null
      echo "done $build t=$threads round $round" >&2
    done
  done
done
