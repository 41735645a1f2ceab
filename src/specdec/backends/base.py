"""The ModelBackend protocol: one forward call serves prefill, a draft step and verification; the backend alone decides
how a step's rows become kernel calls."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specdec.backends.kvcache import ContextOverflowError, KVCache
from specdec.core.sampling import greedy_tokens
from specdec.fim import FimTokens, detect_fim_tokens


@dataclass
class BatchRows:
    """One sequence's rows in a flat batch: tokens appended to its cache, logits for the last num_logits of them.

    num_logits = 0 is a prefill chunk (the caller wants the cache filled, nothing back). `greedy_draft`, given
    with a greedy verification (tokens = [last token] + draft), lets the backend stop computing rows after the
    first whose argmax departs from the draft: the rows past it can no longer be accepted. It then returns the
    logits rows it computed, at least through that first departure.
    """

    tokens: Sequence[int]
    cache: KVCache
    num_logits: int = 1
    greedy_draft: Sequence[int] | None = None


class ModelBackend(ABC):
    """A causal LM behind a uniform, cache-carrying forward, and how it turns a step's rows into kernel calls.

    Subclasses implement `new_cache` and `forward`, and set name, vocab_size, eos_token_ids and max_context. The
    rest has defaults that describe a backend running each sequence's rows in a call of its own: override them
    where the backend batches, prefills apart, or measures its own pass costs.
    """

    name: str
    vocab_size: int  # logits per row
    eos_token_ids: frozenset[int]
    max_context: int  # tokens one cache holds
    tokenizer = None  # a transformers tokenizer, where the backend has one (None: token ids only)
    device = torch.device("cpu")  # where its logits live (the sampling generator is made there)
    num_embeddings: int | None = None  # token ids the model can read when more than vocab_size (a pruned head)
    # Scheduling: rows one call takes (a prompt is prefilled in chunks of it), sequences its memory is sized for
    # (None: no limit of its own), and whether a sequence's logits are bit-identical to decoding it alone.
    batch_size = 512
    parallel: int | None = None
    batch_invariant = False
    # The measured pass cost per row count, which adaptive k policies read (set by calibration), and whether to
    # measure it before the first adaptive request.
    pass_costs: dict[int, float] | None = None
    calibrate_on_first_use = False
    # What the bench and reports read: the torch nn.Module (hooked to time forwards), the GGUF file, the CPU
    # threads, and the backend's own forward counters.
    model = None
    gguf_path = None
    threads: int | None = None
    forward_calls = 0
    forward_seconds = 0.0

    @abstractmethod
    def new_cache(self, capacity: int) -> KVCache: ...

    @abstractmethod
    def forward(self, tokens: Sequence[int], cache: KVCache, num_logits: int = 1) -> torch.Tensor:
        """Append tokens to the cache and return logits [num_logits, vocab] for the last num_logits positions."""

    def forward_batch(self, batch: Sequence[BatchRows]) -> list[torch.Tensor]:
        """Every sequence's rows through the model: float32 logits [num_logits, vocab] per entry, in order
        ([0, vocab] for 0). Every cache appears at most once; on an error every cache is left as it was.
        By default one forward per sequence."""
        return forward_each(self, batch)

    def prefills_apart(self, rows: int, num_logits: int) -> bool:
        """Whether a prompt chunk of `rows` tokens wanting `num_logits` logits runs in a call of its own, whatever
        else the pass holds (the scheduler then gives its first token a step of its own)."""
        return False

    def prompt_rows_beside(self, prompt_rows: int, num_logits: int, other_rows: int) -> int:
        """How many of a prompt chunk's rows to run in a pass beside `other_rows` decode rows, so that the pass
        costs what its calls cost best (the rest waits for the next step); by default all of them."""
        return prompt_rows

    def park_tail(self, cache: KVCache, n: int) -> int:
        """Drop the cache's last n tokens before a new prompt is written there; a backend whose freed cells
        could be taken by other sequences meanwhile may keep them for it. Returns how many were dropped."""
        return cache.trim(n)

    def calibration_options(self) -> dict:
        """Keyword options for calibration.measure_pass_costs on this backend (repeats, warm-up)."""
        return {}

    def calibration_key(self) -> str | None:
        """What a measured pass-cost curve depends on (CPU, library, model, kernels, threads), for the curve cache;
        None: not cached."""
        return None

    def runtime_summary(self, collapsed: bool = True) -> str | None:
        """One line on the kernels, mode and threads the backend runs (None: nothing to say beyond its name)."""
        return None

    def close(self) -> None:
        """Free what the backend holds outside Python's memory (llama.cpp's context); by default nothing."""

    def token_strings(self) -> list[bytes] | None:
        """Every token's stored text by id, for vocabulary checks between two models (None: ask the tokenizer)."""
        return None

    def fim_tokens(self) -> FimTokens:
        """The model's fill-in-the-middle token ids; by default found by their text in the tokenizer's vocabulary
        (as llama.cpp finds them in a GGUF that names no ids), with the BOS the tokenizer puts first."""
        if self.tokenizer is None:
            return FimTokens()
        first = list(self.tokenizer("", add_special_tokens=True)["input_ids"])
        return detect_fim_tokens(self.tokenizer.get_vocab(), bos=first[0] if first else None)


def forward_batch(backend: ModelBackend, batch: Sequence[BatchRows]) -> list[torch.Tensor]:
    """backend.forward_batch(batch), for callers that hold a backend and a batch."""
    return backend.forward_batch(batch)


def check_batch(batch: Sequence[BatchRows], name: str, owns: Callable[[KVCache], bool]) -> list[int]:
    """forward_batch's checks, all before anything runs (a refused batch leaves every cache as it was): caches
    this backend made (`owns`), each at most once, num_logits >= 0, tokens that fit (forward_rows). Returns
    each entry's logits rows: min(num_logits, its tokens)."""
    seen: set[int] = set()
    wanted: list[int] = []
    for rows in batch:
        cache = rows.cache
        if not owns(cache):
            raise ValueError(f"{name}: forward_batch needs caches made by this backend's new_cache")
        if id(cache) in seen:
            raise ValueError(f"{name}: a cache appears more than once in one forward_batch")
        seen.add(id(cache))
        if int(rows.num_logits) < 0:
            raise ValueError(f"num_logits must be >= 0, got {rows.num_logits}")
        forward_rows(rows.tokens, cache, 1, name)  # tokens and room
        wanted.append(min(int(rows.num_logits), len(rows.tokens)))
    return wanted


def forward_each(backend, batch: Sequence[BatchRows]) -> list[torch.Tensor]:
    """forward_batch's contract by one `backend.forward` per sequence (for backends without a batched pass).

    On an error the caches already run are trimmed back (a failing forward restores its own cache).
    """
    results: list[torch.Tensor] = []
    done: list[tuple[KVCache, int]] = []
    try:
        for rows in batch:
            before = rows.cache.length
            logits = backend.forward(rows.tokens, rows.cache, num_logits=max(1, rows.num_logits))
            done.append((rows.cache, before))
            results.append(logits[len(logits) - rows.num_logits:] if rows.num_logits else logits[:0])
    except BaseException:
        for cache, before in done:
            cache.trim(cache.length - before)
        raise
    return results


def forward_rows(tokens: Sequence[int], cache: KVCache, num_logits: int, name: str) -> int:
    """Check a forward call against the cache (every backend's one rule) and return the logits rows to give.

    Raises ValueError for no tokens and ContextOverflowError when the tokens do not fit in the cache.
    """
    n = len(tokens)
    if n == 0:
        raise ValueError("forward needs at least one token")
    if cache.length + n > cache.capacity:
        raise ContextOverflowError(
            f"{cache.length + n} tokens exceed the context of {cache.capacity} tokens for {name}"
        )
    return max(1, min(num_logits, n))


def forward_greedy_in_slices(backend: ModelBackend, rows: BatchRows, slice_rows: int) -> torch.Tensor:
    """A greedy verification (rows.tokens = [last token] + rows.greedy_draft) slice_rows at a time, stopping after
    the first slice in which the argmax departs from the draft. Returns the logits rows computed (all of them
    when every draft token is accepted); on an error the cache is left as it was before the call."""
    cache, proposed = rows.cache, list(rows.greedy_draft or ())
    start = cache.length
    parts: list[torch.Tensor] = []
    try:
        for lo in range(0, len(rows.tokens), slice_rows):
            chunk = list(rows.tokens[lo : lo + slice_rows])
            logits = backend.forward_batch([BatchRows(chunk, cache, len(chunk))])[0]
            parts.append(logits)
            choices = greedy_tokens(logits).tolist()
            if any(choice != proposed[lo + i] for i, choice in enumerate(choices) if lo + i < len(proposed)):
                break
    except BaseException:
        cache.trim(cache.length - start)
        raise
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def embeddable_ids(backend: ModelBackend) -> int:
    """How many token ids a model can read: its embedding rows (llama.cpp: its vocabulary, one row per id)."""
    return int(backend.num_embeddings or backend.vocab_size)
