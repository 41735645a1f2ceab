"""lm-eval's per-sample records of the speculative and the plain run, compared item by item: the scores, and
whether each item's model outputs (the choices' log-likelihoods, the generated text) are the same."""

from __future__ import annotations

import glob
import json
import math
import sys
from pathlib import Path


def samples(run: Path, task: str) -> dict[int, dict]:
    files = glob.glob(str(run / "**" / f"samples_{task}_*.jsonl"), recursive=True)
    if not files:
        raise SystemExit(f"no samples for {task} under {run}")
    return {row["doc_id"]: row for row in map(json.loads, Path(sorted(files)[-1]).read_text().splitlines())}


def outputs(row: dict) -> list:
    return [r[0] if isinstance(r, list) else r for r in row["filtered_resps"]]


def same(a, b) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, abs_tol=1e-3)
    return a == b


def main(out: Path) -> None:
    print("| task | metric | speculative | plain | items | outputs equal |")
    print("|---|---|---|---|---|---|")
    for task, metric in (("specdec_arith_mc", "acc"), ("specdec_arith_gen", "exact_match")):
        spec, plain = samples(out / "speculative", task), samples(out / "plain", task)
        ids = sorted(set(spec) & set(plain))
        equal = sum(same(outputs(spec[i]), outputs(plain[i])) for i in ids)
        score = lambda rows: sum(float(rows[i][metric]) for i in ids) / len(ids)  # noqa: E731
        print(f"| {task} | {metric} | {score(spec):.3f} | {score(plain):.3f} | {len(ids)} | {equal}/{len(ids)} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
