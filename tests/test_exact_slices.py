"""Exact mode verifies a lone greedy draft slice by slice and stops at the first slice that rejects: same output
as plain decoding, fewer rows decoded; the slicing helper's stop rule and rollback on a fake backend."""

from __future__ import annotations

import pytest
import torch

from specdec.backends.base import BatchRows, forward_greedy_in_slices
from specdec.backends.llamacpp.backend import LlamaCppUnavailable, llama_cpp_module
from specdec.config import SamplingParams, SpecConfig
from specdec.drafters.base import Draft, Drafter
from specdec.engine.single import SpeculativeEngine, plain_engine


class _Cache:
    def __init__(self):
        self.length = 0

    def trim(self, n):
        self.length -= n
        return self.length


class _ScriptedTarget:
    """Row i of the whole verification argmaxes to `choices[i]`; records each forward's row count."""

    vocab_size = 8

    def __init__(self, choices, fail_on_call=None):
        self.choices, self.calls, self.fail_on_call = choices, [], fail_on_call

    def forward_batch(self, batch):
        (rows,) = batch
        if self.fail_on_call is not None and len(self.calls) == self.fail_on_call:
            raise RuntimeError("decode failed")
        start = sum(self.calls)
        self.calls.append(len(rows.tokens))
        rows.cache.length += len(rows.tokens)
        logits = torch.zeros(len(rows.tokens), self.vocab_size)
        for i in range(len(rows.tokens)):
            logits[i, self.choices[start + i]] = 1.0
        return [logits]


def test_slices_stop_after_the_first_rejecting_slice():
    proposed = [1, 2, 3, 4, 5, 6, 7, 1, 2]  # 10 rows: [last] + 9 drafted
    rows = lambda: BatchRows([0] + proposed, _Cache(), len(proposed) + 1, greedy_draft=proposed)  # noqa: E731
    # The target agrees on the first 4 draft tokens, then departs (row 4 wants 0, not 5).
    target = _ScriptedTarget(proposed[:4] + [0] + [0] * 5)
    logits = forward_greedy_in_slices(target, rows(), 3)
    assert target.calls == [3, 3]  # rows 0-2 all agree; rows 3-5 hold the disagreement: stop there
    assert logits.argmax(-1).tolist() == proposed[:4] + [0, 0]
    # Every draft token accepted: every slice runs, the last one shorter.
    everything = _ScriptedTarget(proposed + [3])
    assert forward_greedy_in_slices(everything, rows(), 3).shape[0] == 10
    assert everything.calls == [3, 3, 3, 1]
    # The first row already disagrees: one slice.
    first = _ScriptedTarget([0] * 10)
    forward_greedy_in_slices(first, rows(), 3)
    assert first.calls == [3]


def test_a_failing_slice_leaves_the_cache_as_it_was():
    proposed = [1, 2, 3, 4, 5, 6]
    cache = _Cache()
    cache.length = 11
    target = _ScriptedTarget(proposed + [0], fail_on_call=1)
    with pytest.raises(RuntimeError, match="decode failed"):
        forward_greedy_in_slices(target, BatchRows([0] + proposed, cache, 7, greedy_draft=proposed), 3)
    assert cache.length == 11


# -------------------------------------------------------------------- on llama.cpp's exact kernels

class _LongWrongDrafter(Drafter):
    """Proposes k tokens every step: the target's next two tokens when it knows them (from a plain run), then junk."""

    name = "long-wrong"

    def __init__(self, reference: list[int], prompt_length: int):
        self.reference, self.prompt_length = reference, prompt_length

    def begin(self, prompt, params=None, generator=None):
        pass

    def propose(self, context, k):
        done = len(context) - self.prompt_length
        right = self.reference[done : done + 2]
        return Draft((right + [(t * 7 + 3) % 250 for t in range(k)])[:k])

    def accepted(self, num_accepted, num_proposed):
        pass

    def end(self):
        pass


@pytest.fixture(scope="module")
def exact_target(tmp_path_factory):
    try:
        llama_cpp_module()
    except LlamaCppUnavailable as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"llama.cpp is not available: {exc}")
    from specdec.backends.llamacpp.backend import LlamaCppBackend, batch_invariance_problems
    from tiny_gguf import quantize_q4_k_m, write_tiny_gguf

    if batch_invariance_problems():
        pytest.skip(f"this libllama cannot be batch-invariant: {batch_invariance_problems()}")
    root = tmp_path_factory.mktemp("gguf-slices")
    gguf = quantize_q4_k_m(write_tiny_gguf(root / "wide.gguf", seed=3, hidden=256, ffn=512), root / "q4.gguf")
    return LlamaCppBackend(gguf, max_context=256, threads=1, batch_invariant=True)


def _rows_decoded(backend, run) -> int:
    backend.forward_records = []
    try:
        run()
        return sum(rows for rows, _ in backend.forward_records)
    finally:
        backend.forward_records = None


def test_exact_greedy_output_is_plain_decoding_and_long_rejected_drafts_cost_their_first_slices(exact_target):
    prompt = [(i * 37) % 250 for i in range(30)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = plain_engine(exact_target).generate(prompt, params).tokens
    spec = SpecConfig(drafter="long-wrong", num_speculative_tokens=12, k_policy="fixed")
    engine = SpeculativeEngine(exact_target, _LongWrongDrafter(plain, len(prompt)), spec)
    result = []
    decoded = _rows_decoded(exact_target, lambda: result.append(engine.generate(prompt, params)))
    out = result[0]
    assert out.tokens == plain  # bit-identical greedy output
    assert out.stats.num_accepted_tokens > 0
    verified_rows = out.stats.num_draft_tokens + out.stats.num_drafts
    # Each 13-row verification accepted at most 2 tokens: it ran its first slice (3 rows with repacked weights,
    # the probed length with AMX's), not all 13 rows.
    prefill = len(prompt)  # the prompt's last row gives the first token
    slice_rows = max(exact_target.invariant_rows, 3)
    assert slice_rows < 13
    assert decoded - prefill <= out.stats.num_drafts * slice_rows < verified_rows
    # Control: with the same draft in fast mode (one pass of every row), every verified row is decoded.
    exact_target.batch_invariant = False
    try:
        fast = SpeculativeEngine(exact_target, _LongWrongDrafter(plain, len(prompt)), spec)
        result.clear()
        decoded_fast = _rows_decoded(exact_target, lambda: result.append(fast.generate(prompt, params)))
    finally:
        exact_target.batch_invariant = True
    assert decoded_fast - prefill == result[0].stats.num_draft_tokens + result[0].stats.num_drafts
