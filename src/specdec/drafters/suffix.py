"""Suffix drafter: propose the most frequent continuation of the context's longest matching suffix, from a suffix trie over the prompt and the output so far, and a bounded cache of recent outputs across requests (SuffixDecoding).

How (Oliaro et al., "SuffixDecoding", NeurIPS 2025; the same rules as vLLM's `suffix` method, written
here in Python): every substring of up to `depth` tokens of the indexed text is a path in a trie whose
nodes count their occurrences. To draft, the context's last m tokens are matched for every m that
occurs; from the matched node the draft follows the most frequent child while the product of
child/parent counts (an estimate of each token's probability) stays >= min_token_prob, for at most
max_spec_factor * m + max_spec_offset tokens. Among the m, the draft with the largest summed
probability wins, and the same holds between the request's own trie and the cross-request cache.
So a long match (a copy) drafts long, a short or ambiguous one drafts little or nothing. Where the
context's last depth / 2 tokens or more occur earlier, the draft continues past the trie's depth by
speculating again from the context plus the draft so far (SuffixDrafter._plan), up to k.

Deterministic, so drafts carry probs=None (the verifier treats them as one-hot: lossless). The
cross-request cache is bounded by tokens (oldest responses evicted first), lives in this process only
and is never written to disk; SpecConfig.suffix_cache=False turns it off.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec.config import SamplingParams, SpecConfig
from specdec.core.partitions import MAX_PARTITIONS, MAX_PARTITIONS_PER_OWNER, PartitionLRU
from specdec.drafters.base import Draft, Drafter, register_drafter


class _Node:
    """A trie node: how many indexed positions pass through it, and its children.

    children is None (a leaf), a (token, node) pair (one child: most nodes of new text), or a dict; the
    pair saves a dict per node, about half the memory of a trie over text that does not repeat.
    """

    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: None | tuple[int, _Node] | dict[int, _Node] = None

    def get(self, token: int) -> "_Node | None":
        children = self.children
        if children is None:
            return None
        if type(children) is tuple:
            return children[1] if children[0] == token else None
        return children.get(token)

    def child(self, token: int) -> "_Node":
        """The child for token, made if missing."""
        children = self.children
        if children is None:
            node = _Node()
            self.children = (token, node)
            return node
        if type(children) is tuple:
            if children[0] == token:
                return children[1]
            node = _Node()
            self.children = {children[0]: children[1], token: node}
            return node
        node = children.get(token)
        if node is None:
            node = children[token] = _Node()
        return node

    def drop(self, token: int) -> None:
        children = self.children
        if type(children) is tuple:
            self.children = None
        else:
            del children[token]
            if len(children) == 1:
                self.children = next(iter(children.items()))

    def most_frequent(self) -> tuple[int, "_Node"] | None:
        children = self.children
        if children is None:
            return None
        if type(children) is tuple:
            return children
        return max(children.items(), key=lambda item: item[1].count)


@dataclass
class SuffixDraft:
    """A speculation: tokens, each one's estimated probability, their sum (the score), the matched length it
    drafted from, and the longest suffix of the context that occurs at all (a long one marks a copy)."""

    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_length: int = 0
    longest_match: int = 0


class SuffixTrie:
    """Counts of every substring of up to `depth` tokens of the sequences added, with appends and removal.

    add(seq_id, tokens) appends to a sequence (new or known) in O(len(tokens) * depth); remove(seq_id)
    takes a whole sequence's counts back out. Paths whose count falls to zero are deleted.
    """

    def __init__(self, depth: int = 24):
        if depth < 2:
            raise ValueError(f"suffix trie depth must be >= 2, got {depth}")
        self.depth = depth
        self.root = _Node()
        self.sequences: dict[object, list[int]] = {}
        self._active: dict[object, list[_Node]] = {}  # per sequence: nodes of its suffixes, shortest first

    def add(self, seq_id, tokens: Sequence[int]) -> None:
        sequence = self.sequences.setdefault(seq_id, [])
        active = self._active.setdefault(seq_id, [])
        root, limit = self.root, self.depth - 1
        for token in tokens:
            token = int(token)
            sequence.append(token)
            root.count += 1
            first = root.child(token)
            first.count += 1
            extended = [first]
            for node in active[:limit]:  # suffixes at depth < depth grow by one token
                nxt = node.child(token)
                nxt.count += 1
                extended.append(nxt)
            active[:] = extended

    def remove(self, seq_id) -> None:
        sequence = self.sequences.pop(seq_id, None)
        self._active.pop(seq_id, None)
        if not sequence:
            return
        for start in range(len(sequence)):
            node = self.root
            node.count -= 1
            for token in sequence[start : start + self.depth]:
                child = node.get(token)
                child.count -= 1
                if child.count == 0:
                    node.drop(token)
                    break  # the rest of this path hung below the dropped node
                node = child

    def _walk(self, tokens: Sequence[int]) -> _Node | None:
        node = self.root
        for token in tokens:
            node = node.get(int(token))
            if node is None:
                return None
        return node

    def speculate(self, context: Sequence[int], max_tokens: int, max_spec_factor: float = 1.0,
                  max_spec_offset: float = 0.0, min_token_prob: float = 0.1,
                  context_is_indexed: bool = False) -> SuffixDraft:
        """The best-scoring draft over matched suffix lengths m (see the module docstring).

        context_is_indexed: the trie holds `context` itself as its newest text (the request's own trie).
        Then each suffix's own, final occurrence is discounted: it has no continuation yet.

        The longest suffix that occurs is found by bisection (a suffix that does not occur has no longer
        suffix that does), and drafts are compared at it and at halvings of it: O(depth * log depth)
        dictionary steps rather than O(depth ** 2).
        """
        best = SuffixDraft()
        if max_tokens <= 0 or not context:
            return best
        own = 1 if context_is_indexed else 0

        def matched(m: int) -> _Node | None:
            node = self._walk(context[len(context) - m :])
            return node if node is not None and node.count > own else None

        low, high = 0, min(len(context), self.depth - 1)  # matched(low) holds (m = 0: the root)
        while low < high:
            mid = (low + high + 1) // 2
            if matched(mid) is not None:
                low = mid
            else:
                high = mid - 1
        m = low
        best.longest_match = low
        while m >= 1:
            node = matched(m)
            allowed = min(max_tokens, int(m * max_spec_factor + max_spec_offset + 1e-6), self.depth - m)
            draft = _follow(node, node.count - own, allowed, min_token_prob)
            if draft.tokens and draft.score > best.score:
                draft.match_length, draft.longest_match = m, low
                best = draft
            m //= 2
        return best


def _follow(node: _Node, count: int, max_tokens: int, min_token_prob: float) -> SuffixDraft:
    """Walk the most frequent child while the running probability stays >= min_token_prob.

    count: the occurrences of `node` that can continue (its count, less an occurrence that ends the text).
    """
    draft = SuffixDraft()
    prob = 1.0
    while len(draft.tokens) < max_tokens and count > 0:
        best = node.most_frequent()
        if best is None:
            break
        token, child = best
        prob *= child.count / count
        if prob < min_token_prob:
            break
        draft.tokens.append(token)
        draft.probs.append(prob)
        draft.score += prob
        node, count = child, child.count
    return draft


class SuffixCache:
    """The cross-request cache: a SuffixTrie of recent responses, at most max_tokens tokens (oldest evicted)."""

    def __init__(self, max_tokens: int = 8192, depth: int = 24):
        self.max_tokens = max_tokens
        self.trie = SuffixTrie(depth)
        self._order: OrderedDict[int, int] = OrderedDict()  # response id -> length, oldest first
        self._tokens = 0
        self._next_id = 0

    def add_response(self, tokens: Sequence[int]) -> None:
        tokens = list(tokens)[-self.max_tokens :] if self.max_tokens > 0 else []
        if not tokens:
            return
        while self._order and self._tokens + len(tokens) > self.max_tokens:
            oldest, length = self._order.popitem(last=False)
            self.trie.remove(oldest)
            self._tokens -= length
        response_id, self._next_id = self._next_id, self._next_id + 1
        self.trie.add(response_id, tokens)
        self._order[response_id] = len(tokens)
        self._tokens += len(tokens)

    @property
    def num_tokens(self) -> int:
        return self._tokens

    def clear(self) -> None:
        self.trie = SuffixTrie(self.trie.depth)
        self._order.clear()
        self._tokens = 0


class SuffixCachePool:
    """One SuffixCache per cache partition (a tenant and its salt): one partition's outputs never draft for
    another's requests. At most max_partitions caches are kept, and per_owner of one tenant's salts, the least
    recently used dropped first (core.partitions), so memory stays at most max_partitions x the cache's
    max_tokens and one tenant's salts evict only its own caches."""

    def __init__(self, max_tokens: int, depth: int, max_partitions: int = MAX_PARTITIONS,
                 per_owner: int = MAX_PARTITIONS_PER_OWNER):
        self.max_tokens, self.depth = max_tokens, depth
        self._caches: PartitionLRU[SuffixCache] = PartitionLRU(lambda: SuffixCache(max_tokens, depth),
                                                               max_partitions, per_owner)

    def get(self, partition: object) -> SuffixCache:
        return self._caches.get(partition)

    def __len__(self) -> int:
        return len(self._caches)

    def clear(self) -> None:
        self._caches.clear()


class SuffixDrafter(Drafter):
    """Drafts from the request's own suffix trie (prompt + output) and the cross-request cache.

    Sources for the engine's per-source k policies: "suffix-<where>-<m>" with where = "req" or
    "cache" and m the match-length band (1-2, 3-7, 8+), since longer matches are accepted more often.
    """

    name = "suffix"
    can_spawn = True

    def __init__(self, spec: SpecConfig | None = None, caches: SuffixCachePool | None = None):
        self.spec = spec or SpecConfig(drafter=self.name)
        self.depth = self.spec.suffix_depth
        self.caches = caches if caches is not None else (
            SuffixCachePool(self.spec.suffix_cache_tokens, self.depth) if self.spec.suffix_cache else None)
        # The cross-request cache of the partition the current request belongs to (set_partition).
        self.cache = self.caches.get(None) if self.caches is not None else None
        self.local = SuffixTrie(self.depth)
        self.prompt_length = 0
        # next_source's plan for the propose() that follows: (context length, draft, seconds it took)
        self._planned: tuple[int, SuffixDraft, float] | None = None

    def spawn(self) -> "SuffixDrafter":
        """A drafter for another sequence running at the same time: its own trie, the same cross-request cache."""
        return SuffixDrafter(self.spec, self.caches)  # no caches: the spec turned them off, so the new one has none

    def set_partition(self, partition: object) -> None:
        """Draft from, and feed, only the cross-request cache of this request's partition."""
        self.cache = self.caches.get(partition) if self.caches is not None else None

    def begin(self, prompt: Sequence[int], params: SamplingParams | None = None,
              generator: torch.Generator | None = None) -> None:
        self.local = SuffixTrie(self.depth)
        self.local.add(0, prompt)
        self.prompt_length = len(prompt)
        self._planned = None

    def _sync(self, context: Sequence[int]) -> None:
        known = self.local.sequences.get(0, [])
        if len(context) < len(known) or (known and int(context[len(known) - 1]) != known[-1]):
            self.local = SuffixTrie(self.depth)  # the context was rewritten: index it afresh
            self.local.add(0, context)
        elif len(context) > len(known):
            self.local.add(0, context[len(known) :])

    def _speculate(self, context: Sequence[int], k: int, context_is_indexed: bool) -> tuple[SuffixDraft, str]:
        """The better of the request's own trie's draft and the cross-request cache's, and where it came from."""
        spec = self.spec
        args = (spec.suffix_max_factor, spec.suffix_max_offset, spec.suffix_min_prob)
        draft, where = self.local.speculate(context, k, *args, context_is_indexed=context_is_indexed), "req"
        if self.cache is not None:
            cached = self.cache.trie.speculate(context, k, *args)
            if cached.score > draft.score:
                draft, where = cached, "cache"
        return draft, where

    def _plan(self, context: Sequence[int], k: int) -> tuple[SuffixDraft, str]:
        self._sync(context)
        # The request's own trie holds the current context too: its last m tokens always occur there once
        # without a continuation, which speculate discounts.
        draft, where = self._speculate(context, k, context_is_indexed=True)
        # A trie path is at most `depth` tokens, match included, so one speculation drafts at most depth - m
        # tokens. A copy (code edits, quoted text) goes on far longer, and on a CPU long verifications are the
        # cheap ones per row (docs/llamacpp.md), so where the context's last depth / 2 tokens or more occur
        # earlier (a copy: llama.cpp's ngram-simple looks up 12 tokens too), continue from the context plus the
        # draft so far: the match now ends in drafted tokens. A shorter match does not continue: its draft
        # stays within max_spec_factor * m, which keeps drafts short on chat, where such matches often fail.
        # Each token's probability carries the product so far, so min_token_prob holds over the whole draft.
        if draft.longest_match < self.depth // 2:
            return draft, where
        tail = list(context[len(context) - min(len(context), self.depth) :])
        while draft.tokens and len(draft.tokens) < k:
            more, _ = self._speculate(tail + draft.tokens, k - len(draft.tokens), context_is_indexed=False)
            carried = draft.probs[-1]
            added = 0
            for token, prob in zip(more.tokens, more.probs):
                if prob * carried < self.spec.suffix_min_prob:
                    break
                draft.tokens.append(token)
                draft.probs.append(prob * carried)
                draft.score += prob * carried
                added += 1
            if added == 0:
                break
        return draft, where

    def next_source(self, context: Sequence[int]) -> str | None:
        began = time.perf_counter()
        draft, where = self._plan(context, self.spec.num_speculative_tokens)
        self._planned = (len(context), draft, time.perf_counter() - began)
        if not draft.tokens:
            return None
        m = draft.match_length
        band = "1-2" if m <= 2 else ("3-7" if m <= 7 else "8+")
        return f"suffix-{where}-{band}"

    def plan(self, context: Sequence[int]) -> list[int]:
        """The draft propose() would give at the largest k (next_source has just planned it for this context); the
        engine scores it against the tokens that follow, so acceptance is learnt on every step (plan_ledger)."""
        planned = self._planned
        if planned is not None and planned[0] == len(context):
            return planned[1].tokens  # read only: the ledger keeps a copy
        draft, _ = self._plan(context, self.spec.num_speculative_tokens)
        return draft.tokens

    def propose(self, context: Sequence[int], k: int) -> Draft:
        began = time.perf_counter()
        planned, self._planned = self._planned, None
        planning = 0.0
        if planned is not None and planned[0] == len(context):
            _, draft, planning = planned  # planned by next_source for this context with the largest k
        else:
            draft, _ = self._plan(context, k)
        return Draft(list(draft.tokens[:k]), None, time.perf_counter() - began + planning)

    def accepted(self, num_accepted: int, num_proposed: int) -> None:
        pass  # the tries only ever hold the engine's context: accepted tokens

    def forget(self) -> None:
        """Drop the cross-request caches (a repeated measurement must not draft from its own earlier runs)."""
        if self.caches is not None:
            self.caches.clear()
            self.cache = self.caches.get(None)

    def observe(self, context: Sequence[int]) -> None:
        """Put this request's output into the cross-request cache (the prompt is not: it is the user's)."""
        if self.cache is not None:
            self.cache.add_response(list(context)[self.prompt_length :])

    def end(self) -> None:
        self.local = SuffixTrie(self.depth)
        self._planned = None


register_drafter("suffix", lambda draft_backend=None, spec=None, **kw: SuffixDrafter(spec, **kw))

__all__ = ["SuffixCache", "SuffixCachePool", "SuffixDraft", "SuffixDrafter", "SuffixTrie"]
