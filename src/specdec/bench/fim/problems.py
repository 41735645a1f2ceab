"""HumanEval infilling problems (single-line and multi-line gaps), read from the bundled gzipped JSONL, sampled
with a fixed seed: the same problems in the same order for every system and every run."""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"
SETS = {"single": "HumanEval-SingleLineInfilling.jsonl.gz", "multi": "HumanEval-MultiLineInfilling.jsonl.gz"}


@dataclass(frozen=True)
class FimProblem:
    """One gap: the code before and after it, the removed code, and the unit test that judges a completion."""

    task_id: str
    set: str
    prefix: str
    suffix: str
    solution: str
    test: str
    entry_point: str

    @property
    def humaneval_id(self) -> str:
        """The HumanEval problem the gap was cut from (`HumanEval/12`)."""
        return "/".join(self.task_id.split("/")[1:3])


def load_problems(name: str, data: Path = DATA) -> list[FimProblem]:
    """Every problem of a set ('single' or 'multi'), in the file's order."""
    if name not in SETS:
        raise ValueError(f"unknown infilling set {name!r}: choose from {', '.join(SETS)}")
    path = data / SETS[name]
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return [FimProblem(r["task_id"], name, r["prompt"], r["suffix"], r["canonical_solution"], r["test"],
                       r["entry_point"]) for r in rows]


def sample_problems(name: str, count: int, seed: int, data: Path = DATA) -> list[FimProblem]:
    """`count` problems of a set drawn with `seed`, at most one gap per HumanEval problem (so no two share most
    of their text, which would turn the sample into a test of prefix reuse), in the order drawn."""
    problems = load_problems(name, data)
    rng = random.Random(f"{name}:{seed}")
    rng.shuffle(problems)
    chosen: list[FimProblem] = []
    seen: set[str] = set()
    for problem in problems:
        if problem.humaneval_id not in seen:
            seen.add(problem.humaneval_id)
            chosen.append(problem)
        if len(chosen) == count:
            break
    return chosen
