"""BFCL problems (simple, multiple, parallel) read from the bundled gzipped JSONL and sampled with a fixed seed, and
their functions as OpenAI tools (BFCL's `dict`/`float`/`tuple` types spelled as JSON schema's; dotted names, which
OpenAI refuses, with `_` as BFCL's own OpenAI handler writes them)."""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[1] / "data"
SETS = {"simple": "BFCL-simple.jsonl.gz", "multiple": "BFCL-multiple.jsonl.gz", "parallel": "BFCL-parallel.jsonl.gz"}
TYPES = {"dict": "object", "float": "number", "tuple": "array", "int": "integer", "bool": "boolean", "str": "string",
         "list": "array"}


@dataclass(frozen=True)
class ToolProblem:
    """One question, the functions offered, and the calls BFCL accepts ({function: {argument: [values]}})."""

    id: str
    set: str
    messages: list[dict[str, Any]]
    functions: list[dict[str, Any]]
    ground_truth: list[dict[str, dict[str, list]]]


def load_problems(name: str, data: Path = DATA) -> list[ToolProblem]:
    if name not in SETS:
        raise ValueError(f"unknown BFCL set {name!r}: choose from {', '.join(SETS)}")
    with gzip.open(data / SETS[name], "rt", encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return [ToolProblem(r["id"], name, r["question"][0], r["function"], r["ground_truth"]) for r in rows]


def sample_problems(name: str, count: int, seed: int, data: Path = DATA) -> list[ToolProblem]:
    """`count` problems of a set, the same for a seed on every machine (random.Random(seed) over the file order)."""
    problems = load_problems(name, data)
    return random.Random(f"{seed}:{name}").sample(problems, min(count, len(problems)))


def openai_name(name: str) -> str:
    return name.replace(".", "_")


def json_schema(value: Any) -> Any:
    """BFCL's parameter description as JSON schema: its type names mapped (`any`: no type), recursively."""
    if isinstance(value, list):
        return [json_schema(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for key, item in value.items():
        if key == "type" and isinstance(item, str):
            if item == "any":
                continue
            out[key] = TYPES.get(item, item)
        elif key in ("properties",) and isinstance(item, dict):
            out[key] = {name: json_schema(schema) for name, schema in item.items()}
        elif key in ("items", "additionalProperties", "anyOf", "oneOf", "allOf"):
            out[key] = json_schema(item)
        else:
            out[key] = item
    return out


def openai_tools(problem: ToolProblem) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": openai_name(f["name"]), "description": f.get("description", ""),
                                              "parameters": json_schema(f.get("parameters") or {"type": "object"})}}
            for f in problem.functions]
