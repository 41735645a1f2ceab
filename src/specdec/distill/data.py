"""Distillation data: prompts (a JSONL file or a bench task, split into train and held-out) and the target's
continuations of the training prompts with its top-K token distributions at every continuation position."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.backends.base import forward_batch
from specdec.backends.kvcache import ContextOverflowError
from specdec.bench.datasets import BenchPrompt, DatasetError, load_prompt_file, load_tasks, parse_tasks
from specdec.config import SamplingParams
from specdec.distill.losses import topk_log_probs
from specdec.engine.single import plain_engine

DEFAULT_TOP_K = 64


@dataclass(frozen=True)
class PromptSplit:
    """Training prompts and held-out prompts (never trained on) for the before/after report."""

    train: list[BenchPrompt]
    heldout: list[BenchPrompt]


@dataclass
class DistillExample:
    """One training sequence: prompt ids, the target's continuation, and its top-K log-probs per continuation token.

    topk_ids[i] / topk_log_probs[i] describe the target's distribution of continuation[i] given everything
    before it, renormalised over those K ids (p = 0 outside them).
    """

    prompt_id: str
    prompt: list[int]
    continuation: list[int]
    topk_ids: torch.Tensor  # [len(continuation), K] long
    topk_log_probs: torch.Tensor  # [len(continuation), K] float32


def split_prompt_file(path: str | Path, holdout: int, heldout_path: str | Path | None = None) -> PromptSplit:
    """Train on the file's prompts; hold out the last `holdout` of them, or every prompt of heldout_path."""
    prompts = load_prompt_file(path)
    if heldout_path is not None:
        return PromptSplit(prompts, load_prompt_file(heldout_path))
    if not 1 <= holdout < len(prompts):
        raise DatasetError(f"--holdout must be in [1, {len(prompts) - 1}] for {len(prompts)} prompts, got {holdout}")
    return PromptSplit(prompts[:-holdout], prompts[-holdout:])


def split_task(task: str, holdout: int, eval_tasks: Sequence[str] | None = None) -> PromptSplit:
    """Train on a bench task's prompts except its last `holdout` problems; evaluate those problems on eval_tasks.

    The held-out problems are the same HumanEval problems in every eval task (e.g. humaneval and code_edit), so
    no held-out prompt shares a problem with a training prompt.
    """
    names = parse_tasks(task)
    if len(names) != 1:
        raise DatasetError("--task takes one task (train on it); give the evaluation tasks with --eval-tasks")
    name = names[0]
    prompts = load_tasks([name])
    if not 1 <= holdout < len(prompts):
        raise DatasetError(f"--holdout must be in [1, {len(prompts) - 1}] for {len(prompts)} {name} prompts, "
                           f"got {holdout}")
    heldout_ids = {p.id for p in prompts[-holdout:]}
    evaluation = load_tasks(parse_tasks(",".join(eval_tasks or [name])))
    return PromptSplit(
        [p for p in prompts if p.id not in heldout_ids], [p for p in evaluation if p.id in heldout_ids]
    )


class TopKRecorder:
    """A ModelBackend proxy that keeps the top-K log-probs of every logits row the wrapped backend returns.

    Plain decoding asks for exactly one row per generated token (the row that chose it), so the rows of a
    generation's last n forwards are the target's distributions of its n tokens: the continuation is scored
    while it is generated, with no second pass over it.
    """

    def __init__(self, backend, top_k: int = DEFAULT_TOP_K):
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.backend = backend
        self.top_k = top_k
        self.rows: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, tokens, cache, num_logits: int = 1) -> torch.Tensor:
        logits = self.backend.forward(tokens, cache, num_logits)
        ids, log_probs = topk_log_probs(logits, self.top_k)
        self.rows += list(zip(ids, log_probs))
        return logits

    def forward_batch(self, batch) -> list[torch.Tensor]:
        """The engine's path (one pass over its sequences' rows): recorded like forward."""
        results = forward_batch(self.backend, batch)
        for logits in results:
            if len(logits):
                ids, log_probs = topk_log_probs(logits, self.top_k)
                self.rows += list(zip(ids, log_probs))
        return results

    def __getattr__(self, name):
        return getattr(self.backend, name)


def collect_examples(
    target,
    prompts: Sequence[tuple[str, Sequence[int]]],
    params: SamplingParams | None = None,
    top_k: int = DEFAULT_TOP_K,
    progress: bool = True,
) -> tuple[list[DistillExample], list[str]]:
    """The target's continuations of (prompt id, token ids) pairs with its top-K distributions.

    params: how the target continues (default greedy, 64 tokens); the stored distributions are the target's
    own (temperature 1) whatever the decoding. Returns the examples and the ids of prompts that do not fit
    the target's context (skipped).
    """
    params = params or SamplingParams(max_tokens=64)
    recorder = TopKRecorder(target, top_k)
    engine = plain_engine(recorder)
    examples: list[DistillExample] = []
    skipped: list[str] = []
    for prompt_id, ids in tqdm(prompts, desc="target continuations", unit="prompt", disable=not progress):
        recorder.rows = []
        try:
            generation = engine.generate(list(ids), params)
        except ContextOverflowError:
            skipped.append(prompt_id)
            continue
        n = len(generation.tokens)
        rows = recorder.rows[-n:]
        examples.append(DistillExample(
            prompt_id, list(ids), list(generation.tokens),
            torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]),
        ))
    return examples, skipped


def save_examples(path: str | Path, examples: Sequence[DistillExample], meta: dict | None = None) -> Path:
    """Keep collected data (the costly phase) so a later run can train on it with --data."""
    path = Path(path)
    torch.save({"meta": meta or {}, "examples": [vars(e) for e in examples]}, path)
    return path


def load_examples(path: str | Path) -> tuple[list[DistillExample], dict]:
    try:
        data = torch.load(Path(path), weights_only=True)
        return [DistillExample(**e) for e in data["examples"]], data.get("meta", {})
    except (OSError, KeyError, TypeError, RuntimeError) as exc:
        raise DatasetError(f"cannot read distillation data {path}: {exc}") from exc


__all__ = [
    "DEFAULT_TOP_K", "DistillExample", "PromptSplit", "TopKRecorder", "collect_examples", "load_examples",
    "load_prompt_file", "save_examples", "split_prompt_file", "split_task",
]
