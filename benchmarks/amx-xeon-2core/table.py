"""Print the llama-bench runs in this folder as ms per pass of n rows, AMX vs non-AMX, per thread count (mean of rounds)."""

import json
import statistics
import sys
from pathlib import Path

folder = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
runs: dict[tuple[str, int], dict[int, list[float]]] = {}
for path in sorted(folder.glob("llama-bench-*.json")):
    build, threads = path.stem.split("-")[2], int(path.stem.split("-")[3][1:])
    try:
        tests = json.loads(path.read_text())
    except ValueError:
        print(f"(skipped {path.name}: not complete JSON)", file=sys.stderr)
        continue
    for test in tests:
        rows = test["n_prompt"]
        runs.setdefault((build, threads), {}).setdefault(rows, []).append(1000 * rows / test["avg_ts"])
for threads in sorted({t for _, t in runs}, reverse=True):
    amx, plain = runs.get(("amx", threads), {}), runs.get(("noamx", threads), {})
    counts = sorted(set(amx) | set(plain))
    print(f"\n{threads} thread(s): ms per pass of n rows (mean of {len(next(iter(amx.values()), []))} rounds x 3 reps)\n")
    print("| build | " + " | ".join(str(n) for n in counts) + " |")
    print("|---|" + "---:|" * len(counts))
    for name, data in (("AVX-512/VNNI, repacked, no AMX", plain), ("same + AMX (tile config kept)", amx)):
        print(f"| {name} | " + " | ".join(f"{statistics.mean(data[n]):.1f}" for n in counts) + " |")
    print("| no-AMX / AMX | " + " | ".join(f"{statistics.mean(plain[n]) / statistics.mean(amx[n]):.2f}x"
                                          for n in counts) + " |")
