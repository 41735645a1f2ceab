"""The copy bound: the most any drafter that copies from its context (prompt lookup, the suffix drafter) could buy on a given output, at measured pass costs.

A copying drafter can only propose a span that already stands in its context: the prompt, the output so far
and, across requests, earlier outputs. So where the target's next tokens are out[i:], at most the longest
prefix of out[i:] that occurs in that context can be accepted. The copy bound gives a drafter that always
knew that prefix, and drafted exactly the length that minimises the total cost of the output on the
measured curve (dynamic programming over positions): the best decode-time speedup copying can buy on this
text and this machine. The machine's ceiling (calibration.machine_ceiling) assumes every drafted token is
accepted; the copy bound says how much of it the text itself leaves to a copying drafter, and what a
drafter reached over the copy bound says how much of that it found. Pure functions; no model.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from specdec.kpolicy.calibration import cost_table, interpolate_cost


def copyable_lengths(prompt: Sequence[int], output: Sequence[int], max_len: int,
                     history: Sequence[Sequence[int]] = (), chain_overlap: int | None = None) -> list[int]:
    """For each i, the longest L <= max_len such that output[i:i + L] occurs, whole, inside one source:
    prompt + output[:i] (the request's own context at that point) or one of the earlier outputs in history.
    A span never crosses from one source into another, nor past the end of the context at position i.

    chain_overlap: also count spans chained where the next one begins at least chain_overlap tokens before the
    last one ends (the suffix drafter continues a draft by matching its last depth / 2 tokens again,
    SuffixDrafter._plan), each span checked against the context at its own start, which holds more than the
    drafter's: a relaxation, so the bound stays an upper bound."""
    output = list(output)
    n = len(output)
    if max_len <= 0 or n == 0:
        return [0] * n
    earlier = [list(tokens) for tokens in history if tokens]
    earlier_at: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for source, tokens in enumerate(earlier):
        for position, token in enumerate(tokens):
            earlier_at[token].append((source, position))
    context = list(prompt)
    context_at: dict[int, list[int]] = defaultdict(list)
    for position, token in enumerate(context):
        context_at[token].append(position)
    lengths = []
    for i in range(n):
        cap = min(max_len, n - i)
        best = 0
        for start in context_at.get(output[i], ()):
            best = max(best, _match(context, start, output, i, cap))
            if best == cap:
                break
        if best < cap:
            for source, start in earlier_at.get(output[i], ()):
                best = max(best, _match(earlier[source], start, output, i, cap))
                if best == cap:
                    break
        lengths.append(best)
        context.append(output[i])
        context_at[output[i]].append(len(context) - 1)
    if chain_overlap:
        # A next span may begin anywhere in the current one that leaves chain_overlap tokens before its end; those
        # positions come later, so their (chained) lengths are final when position i is reached.
        for i in range(n - 1, -1, -1):
            cap = min(max_len, n - i)
            if chain_overlap < lengths[i] < cap:
                reach = max(r - i + lengths[r] for r in range(i + 1, i + lengths[i] - chain_overlap + 1))
                lengths[i] = min(cap, max(lengths[i], reach))
    return lengths


def _match(source: list[int], start: int, output: list[int], i: int, cap: int) -> int:
    length = 0
    while length < cap and start + length < len(source) and source[start + length] == output[i + length]:
        length += 1
    return length


def cheapest_decode_cost(copyable: Sequence[int], curve: Mapping[int, float], max_k: int,
                         first_from_prefill: bool = True) -> tuple[float, int]:
    """(the least total pass cost that emits every output token, its number of passes), where the pass at
    position i may draft k <= min(copyable[i], max_k) tokens and then emits k + 1 tokens for one pass of k + 1
    rows. The first token comes from the prefill pass when first_from_prefill (as in our engine and
    llama-server), so decoding starts at position 1."""
    n = len(copyable)
    start = 1 if first_from_prefill else 0
    if n <= start:
        return 0.0, 0
    row_cost = cost_table(curve, list(range(1, max_k + 2)))  # row_cost[r - 1]: one pass of r rows
    best = [0.0] * (n + 1)
    passes = [0] * (n + 1)
    for i in range(n - 1, start - 1, -1):
        # A pass at i emits output[i : i + k + 1], so k <= n - 1 - i, and drafts only what is copyable there.
        top = min(copyable[i], max_k, n - 1 - i)
        best_cost, best_passes = row_cost[0] + best[i + 1], passes[i + 1] + 1
        for k in range(1, top + 1):
            cost = row_cost[k] + best[i + k + 1]
            if cost < best_cost:
                best_cost, best_passes = cost, passes[i + k + 1] + 1
        best[i], passes[i] = best_cost, best_passes
    return best[start], passes[start]


def copy_bound(prompt: Sequence[int], output: Sequence[int], curve: Mapping[int, float], max_k: int,
               history: Sequence[Sequence[int]] = (), chain_overlap: int | None = None) -> dict:
    """The copy bound of one output: plain decoding's decode cost (one one-row pass per token after the first),
    the cheapest copying drafter's, and their ratio (decode-time speedup), in the curve's units."""
    copyable = copyable_lengths(prompt, output, max_k, history, chain_overlap)
    cost, passes = cheapest_decode_cost(copyable, curve, max_k)
    decoded = max(0, len(output) - 1)
    plain = decoded * interpolate_cost(curve, 1)
    return {"tokens": decoded, "plain_cost": plain, "copy_cost": cost, "passes": passes,
            "copyable_tokens": sum(1 for length in copyable[1:] if length),
            "speedup": plain / cost if cost else 1.0}


def combined_speedup(bounds: Sequence[dict]) -> float | None:
    """Over several outputs, as decode tok/s over a set is aggregated: total plain cost / total copy cost."""
    plain = sum(b["plain_cost"] for b in bounds)
    cost = sum(b["copy_cost"] for b in bounds)
    return plain / cost if cost else None


__all__ = ["cheapest_decode_cost", "combined_speedup", "copy_bound", "copyable_lengths"]
