"""Drafter that runs a small causal LM autoregressively, with its own KV cache rolled back after verification."""

from __future__ import annotations

import time
from typing import Sequence

import torch

from specdec.backends.base import BatchRows, embeddable_ids, forward_batch
from specdec.backends.kvcache import RetainedPrefix, common_prefix_length
from specdec.config import SamplingParams, SpecConfig
from specdec.core.sampling import greedy_tokens, probabilities, sample_token
from specdec.drafters.base import Draft, Drafter, register_drafter


class DraftModelDrafter(Drafter):
    """Proposes up to k tokens from a draft model; q goes through the same sampling transform as the target.

    Cache invariant between calls: the draft cache holds a prefix of the engine's context, so each
    propose() first feeds whatever the cache is missing (the recovered/bonus token, and after a
    fully accepted draft, the last draft token) in one forward. The prompt is fed lazily by the first
    propose(), so a request whose policy never drafts (k = 0 on a compute-bound CPU, or prompt lookup
    always matching in the hybrid) never pays for it. That first catch-up is timed apart from drafting
    (Draft.catchup_seconds: a one-off); later ones, after steps this drafter sat out, are part of what
    drafting costs and stay in Draft.seconds, so the k policy sees them.

    Prefix reuse: the cache outlives the request. `self.retained.tokens` is kept equal to what it holds
    (prompt, accepted tokens, and draft tokens of the last step that were never rolled back), and
    begin() keeps their longest common prefix with the new prompt minus its last token, so the
    catch-up feeds only the rest. Always allowed, whatever the target: the draft only proposes, and
    the target verifies every token. `prefix_cache` (the engine sets it from its own switch) turns it off.
    """

    name = "draft_model"
    can_spawn = True

    def __init__(self, draft_backend, spec: SpecConfig | None = None, **_: object):
        if draft_backend is None:
            raise ValueError("the draft_model drafter needs a draft model (--draft)")
        self.backend = draft_backend
        self.spec = spec or SpecConfig()
        self.cache = None
        self.prefix_cache = self.spec.prefix_cache
        self.retained = RetainedPrefix()
        self.num_cached_prompt_tokens = 0  # prompt tokens this request found in the cache
        self._fed_draft = 0  # draft tokens written to the cache by the last propose()
        self._prompt_fed = False  # whether this request's first catch-up (the prompt) has happened
        # Ids the draft model can embed (llama.cpp's table has one row per vocabulary id). load_pair refuses a
        # draft that cannot read the target's tokens; a padding id the target scores may still turn up.
        self.embeddable = embeddable_ids(draft_backend)
        self._checked = 0  # context tokens already checked against self.embeddable
        self._unreadable = False  # the context holds an id the draft model cannot embed

    def spawn(self) -> "DraftModelDrafter":
        """A drafter for another sequence running at the same time: the same draft model, a cache of its own."""
        return DraftModelDrafter(self.backend, self.spec)

    def begin(self, prompt: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None:
        self.params = params
        self.generator = generator
        if self.cache is None:
            self.cache = self.backend.new_cache(self.backend.max_context)
        # At most prompt[:-1]: the first propose() must feed at least the last context token for its logits.
        self.num_cached_prompt_tokens = self.retained.claim(self.backend, self.cache, prompt[:-1],
                                                            self.prefix_cache)
        self._fed_draft = 0
        self._prompt_fed = False
        self._checked = 0
        self._unreadable = False

    def can_draft(self, context: Sequence[int]) -> bool:
        """False from the first context id the draft model has no embedding for until the request ends.

        Such an id (a prompt id, or one the target produced from a padding row of its head) can never
        be fed to the draft model, so the rest of the request decodes plainly instead of crashing.
        """
        if not self._unreadable:
            limit = self.embeddable
            self._unreadable = any(int(t) >= limit for t in context[self._checked :])
            self._checked = len(context)
        return not self._unreadable

    def next_source(self, context: Sequence[int]) -> str | None:
        return self.name if self.can_draft(context) else None

    def propose(self, context: Sequence[int], k: int) -> Draft:
        return propose_together([(self, context, k)])[0]

    def batch_key(self) -> object:
        """Drafters on one draft model draft together: their forwards share passes."""
        return id(self.backend)

    @staticmethod
    def propose_batch(requests: Sequence[tuple["DraftModelDrafter", Sequence[int], int]]) -> list[Draft]:
        """Drafts for several sequences at once (the scheduler's hook): see propose_together."""
        return propose_together(requests)

    def _drafting(self, context: Sequence[int], k: int):
        """Draft k tokens as a coroutine: yields each forward it needs (BatchRows on its cache) and receives that
        forward's logits, so several drafters' forwards can share one pass (propose_together). Returns the tokens
        and their distributions (None when greedy)."""
        held = self.retained.tokens  # what the cache holds, kept in step with every forward and trim
        # A grammar's forced tokens are fed ahead of the draft (BatchEngine: the draft continues after them); the
        # target may still reject one (the same text, tokenized otherwise): the cache then drops what the context lost.
        recent = max(0, len(held) - _REALIGN_WINDOW)
        agree = recent + common_prefix_length(held[recent:], context[recent:len(held)])
        if agree < len(held):
            self.cache.trim(len(held) - agree)
            del held[agree:]
        pending = list(context[self.cache.length :])
        if len(pending) > 2:
            # More than the usual 1-2 tokens behind: feed the backlog as its own (prefill-like) forward.
            yield BatchRows(pending[:-1], self.cache, 0)
            held += pending[:-1]
            pending = pending[-1:]
            if not self._prompt_fed:
                yield _CATCHUP_DONE
        self._prompt_fed = True
        logits = (yield BatchRows(pending, self.cache, 1))[-1]
        held += pending
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(k):
            if self.params.greedy:
                token = int(greedy_tokens(logits))
                top_prob = float(torch.softmax(logits, dim=-1)[token]) if self.spec.draft_p_min > 0 else 1.0
            else:
                q = probabilities(logits, self.params)
                token = sample_token(q, self.generator)
                top_prob = float(q.max()) if self.spec.draft_p_min > 0 else 1.0  # a host read: only when used
                rows.append(q)
            if i > 0 and top_prob < self.spec.draft_p_min:
                if rows:
                    rows.pop()
                break
            tokens.append(token)
            if i < k - 1:
                logits = (yield BatchRows([token], self.cache, 1))[-1]
                held.append(token)
        self._fed_draft = len(tokens) - 1 if len(tokens) == k else len(tokens)
        # The cache now holds context + every proposed token except possibly the last.
        return tokens, (torch.stack(rows) if rows else None)

    def accepted(self, num_accepted: int, num_proposed: int) -> None:
        dropped = self.cache.trim(max(0, self._fed_draft - num_accepted))
        if dropped:
            del self.retained.tokens[-dropped:]
        self._fed_draft = 0

    def end(self) -> None:
        """Keep the cache's tokens for the next request (emptied when prefix_cache is off)."""
        self.retained.release(self.prefix_cache)


_REALIGN_WINDOW = 64  # how far back the cache is checked against the context: past a step's forced tokens
_CATCHUP_DONE = object()  # yielded by _drafting once the first catch-up (the prompt) has been fed


def propose_together(requests: Sequence[tuple["DraftModelDrafter", Sequence[int], int]]) -> list[Draft]:
    """Drafts for several sequences, (drafter, context, k) each, whose draft models share a backend: every round
    runs one forward over all their pending rows (backends.base.forward_batch), so a draft model drafts for N
    sequences in about k passes instead of N * k. One request is the single-sequence propose().

    Each Draft's seconds are its share of the drafting time (the whole time over the drafters in it), less the
    first catch-up on the prompt (catchup_seconds), which is kept out of the per-token cost model.
    """
    began = time.perf_counter()
    drafts: list[Draft | None] = [None] * len(requests)
    running: dict[int, object] = {}
    catchup: dict[int, float] = {}
    for index, (drafter, context, k) in enumerate(requests):
        room = drafter.cache.capacity - len(context)
        k = max(0, min(k, room))
        if k == 0 or not drafter.can_draft(context):
            drafts[index] = Draft([], None, 0.0)
        else:
            running[index] = drafter._drafting(context, k)
    sent: dict[int, object] = {index: None for index in running}
    try:
        while running:
            wanted: dict[int, BatchRows] = {}
            for index in list(running):
                try:
                    request = running[index].send(sent[index])
                    while request is _CATCHUP_DONE:
                        catchup[index] = time.perf_counter() - began
                        request = running[index].send(None)
                    wanted[index] = request
                except StopIteration as done:
                    tokens, probs = done.value
                    drafts[index] = Draft(tokens, probs)
                    del running[index]
            if not wanted:
                break
            backend = requests[next(iter(wanted))][0].backend
            logits = forward_batch(backend, list(wanted.values()))
            sent = dict(zip(wanted, logits))
    except BaseException:
        for drafter, _, _ in requests:
            drafter.retained.drop()  # a forward failed part way: what the caches hold is not certain
        raise
    share = (time.perf_counter() - began) / max(1, sum(1 for d in drafts if d is not None and d.tokens))
    for index, draft in enumerate(drafts):
        if draft.tokens:
            draft.catchup_seconds = catchup.get(index, 0.0)
            draft.seconds = max(0.0, share - draft.catchup_seconds)
        else:
            draft.seconds = time.perf_counter() - began if len(requests) == 1 else 0.0
    return drafts


register_drafter("draft_model", lambda draft_backend=None, spec=None, **kw: DraftModelDrafter(draft_backend, spec))
