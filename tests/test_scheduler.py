"""BatchEngine: many sequences in one step give each the output it gets alone, follow the target's distribution, keep
every stop rule, join and leave at step boundaries, and do not stall behind a long prefill."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from specdec.backends.llamacpp.backend import LlamaCppBackend
from specdec.config import SamplingParams, SpecConfig
from specdec.core.verify import Verdict
from specdec.drafters import create_drafter
from specdec.engine import scheduler
from specdec.engine.scheduler import BatchEngine
from specdec.engine.single import SpeculativeEngine, plain_engine
from specdec.kpolicy.adaptive import AdaptiveK, Ewma
from test_engine import SAMPLED, PrefixLM, chi_square_p, exact_sequence_distribution


def run_all(engine: BatchEngine, requests, join_at=None):
    """Admit requests (prompt, params) — request i at step join_at[i] (0 by default) — and step until all end.

    Returns per request: (tokens, text, finish reason) and the largest number of sequences seen in one step."""
    join_at = join_at or [0] * len(requests)
    results = {i: ([], [], None) for i in range(len(requests))}
    handles, tag_of = {}, {}
    step = 0
    most = 0
    while len(handles) < len(requests) or engine.running:
        for i, (prompt, params) in enumerate(requests):
            if i not in handles and join_at[i] <= step and engine.has_room:
                handles[i] = engine.add(prompt, params, tag=i)
                tag_of[handles[i].request_id] = i
        most = max(most, len(engine.running))
        for output in engine.step():
            assert output.error is None, output.error
            tokens, texts, _ = results[tag_of[output.request_id]]
            tokens += output.tokens
            texts.append(output.text)
            results[tag_of[output.request_id]] = (tokens, texts, output.finish_reason)
        step += 1
        assert step < 10_000
    return [(t, "".join(x), f) for t, x, f in (results[i] for i in range(len(requests)))], most


def spec_pieces(target, draft, k=3, policy="fixed", drafter="draft_model"):
    spec = SpecConfig(num_speculative_tokens=k, k_policy=policy, drafter=drafter)
    return create_drafter(drafter, draft_backend=draft, spec=spec), spec


PROMPTS = [[1, 2, 3], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7], [5], [2, 9, 4, 2, 9, 4, 2, 9]]


def test_each_sequence_gets_what_it_gets_alone():
    """Greedy, fixed k: four requests joining at different steps, with different budgets and stop strings, give
    the tokens, text and finish reason each gets from the one-request engine, which equal plain decoding."""
    target = PrefixLM(vocab=12, seed=3, max_context=128)
    draft = PrefixLM(vocab=12, seed=4, scale=0.5, base=target, max_context=128)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, stop=stop)
              for n, stop in ((20, ()), (9, ()), (25, ("3 4",)), (14, ("11",)))]
    requests = list(zip(PROMPTS, params))
    drafter, spec = spec_pieces(target, draft)
    batch = BatchEngine(target, drafter, spec, letters_decoder(), max_running=3)
    results, most = run_all(batch, requests, join_at=[0, 0, 2, 5])
    assert most == 3  # the fourth waited for a slot
    for (prompt, p), got in zip(requests, results):
        solo_drafter, solo_spec = spec_pieces(target, draft)
        alone = SpeculativeEngine(target, solo_drafter, solo_spec, letters_decoder()).generate(prompt, p)
        plain = plain_engine(target, letters_decoder()).generate(prompt, p)
        assert got == (alone.tokens, alone.text, alone.finish_reason)
        assert alone.tokens == plain.tokens
    assert batch.total_stats.num_accepted_tokens > 0 and batch.total_stats.num_draft_tokens > \
        batch.total_stats.num_accepted_tokens  # drafts were accepted and rejected: verification was exercised


def letters_decoder():
    return lambda ids: " ".join(str(i) for i in ids)


def test_sampled_sequences_side_by_side_follow_the_target(monkeypatch):
    """Sampled, k=3: six sequences share every step, each with its own seed; their first three tokens jointly
    follow the target (chi-square against the exact distribution), and a negative control whose verifier accepts
    every draft is rejected: the test can fail."""

    target = PrefixLM(vocab=4, seed=11)
    draft = PrefixLM(vocab=4, seed=12, scale=1.2, base=target)
    exact = exact_sequence_distribution(target, [1, 2], SAMPLED, 3)
    counts = sample_batched(target, draft, 3000)
    p_value, tv = chi_square_p(counts, exact)
    assert p_value > 1e-3 and tv < 0.06, (p_value, tv)

    def always_accept(tokens, draft_probs, target_probs, generator):
        from specdec.core.sampling import sample_token

        return Verdict(len(tokens), sample_token(target_probs[len(tokens)], generator), True)

    monkeypatch.setattr(scheduler, "verify_sampled", always_accept)
    broken = sample_batched(target, draft, 1500)
    p_broken = chi_square_p(broken, exact)[0] if not ((exact == 0) & (broken > 0)).any() else 0.0
    assert p_broken < 1e-6, p_broken


def sample_batched(target, draft, draws: int, width: int = 6) -> np.ndarray:
    drafter, spec = spec_pieces(target, draft)
    engine = BatchEngine(target, drafter, spec, max_running=width)
    counts = np.zeros(4**3, dtype=np.int64)
    seed = 0
    while seed < draws:
        tokens = {}
        for _ in range(min(width, draws - seed)):
            tokens[engine.add([1, 2], dataclasses.replace(SAMPLED, seed=seed)).request_id] = []
            seed += 1
        while engine.running:
            outputs = engine.step()
            assert len(outputs) == len(tokens) or not engine.running or len(outputs) <= len(tokens)
            for output in outputs:
                tokens[output.request_id] += output.tokens
        for got in tokens.values():
            assert len(got) == 3
            counts[np.ravel_multi_index(got, [4] * 3)] += 1
    return counts


def test_eos_max_tokens_and_stop_strings_inside_drafts_per_sequence():
    """A draft that runs past EOS, max_tokens or a stop string is cut at the same token as plain decoding, for
    each sequence of the step independently."""
    target = PrefixLM(vocab=10, seed=5, max_context=128)
    plain = plain_engine(target, letters_decoder())
    free = plain.generate([4, 4], SamplingParams(max_tokens=30, ignore_eos=True)).tokens
    eos_token, stop_text = free[6], f"{free[10]} {free[11]}"
    eos_target = PrefixLM(vocab=10, seed=5, max_context=128)
    eos_target.eos_token_ids = frozenset([eos_token])
    requests = [([4, 4], SamplingParams(max_tokens=30)), ([4, 4], SamplingParams(max_tokens=5, ignore_eos=True)),
                ([4, 4], SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop_text,)))]
    drafter, spec = spec_pieces(eos_target, eos_target, k=6)  # the draft is the target: every draft is accepted
    batch = BatchEngine(eos_target, drafter, spec, letters_decoder(), max_running=3)
    results, _ = run_all(batch, requests)
    for (prompt, params), got in zip(requests, results):
        want = plain_engine(eos_target, letters_decoder()).generate(prompt, params)
        assert got == (want.tokens, want.text, want.finish_reason)
    assert [r[2] for r in results] == ["stop", "length", "stop"]


def test_prefill_is_chunked_and_running_streams_keep_going():
    """A long prompt admitted beside a running stream is prefilled in chunks; the running stream emits at every
    step meanwhile, and the newcomer's output is still what it gets alone."""
    target = PrefixLM(vocab=12, seed=8, max_context=512)
    batch = BatchEngine(target, None, SpecConfig(drafter="none"), max_running=2, prefill_chunk=16)
    first = batch.add([1, 2], SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        batch.step()
    long_prompt = [(i * 7) % 12 for i in range(100)]
    second = batch.add(long_prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    steps_while_prefilling = 0
    second_tokens = []
    while second.prefilling:
        outputs = batch.step()
        emitted = {o.request_id for o in outputs}
        assert first.request_id in emitted  # the running stream emitted at every step
        # The newcomer emits its first token from the pass of its last chunk, not before.
        assert (second.request_id in emitted) == (not second.prefilling)
        second_tokens += [t for o in outputs if o.request_id == second.request_id for t in o.tokens]
        steps_while_prefilling += 1
    assert steps_while_prefilling == -(-100 // 16)  # 100 prompt tokens, 16 per step
    assert len(second_tokens) == 1
    while not second.finished:
        second_tokens += [t for o in batch.step() if o.request_id == second.request_id for t in o.tokens]
    assert second_tokens == plain_engine(target).generate(long_prompt, SamplingParams(max_tokens=5,
                                                                                      ignore_eos=True)).tokens
    assert not first.finished


def test_a_burst_of_prompts_prefills_shortest_first_one_prompt_per_pass(monkeypatch):
    """Waiting prompts are prefilled one per pass, the one with the fewest tokens left first (a prompt passed over
    ages by the rows prefilled for others), in whole chunks; each prompt's last chunk gives its first token in that
    pass, and every output is still what it gets alone."""
    target = PrefixLM(vocab=12, seed=11, max_context=512)
    batch = BatchEngine(target, None, SpecConfig(drafter="none"), max_running=4, prefill_chunk=16)
    prompts = [[(i * (3 + n)) % 12 for i in range(length)] for n, length in enumerate((30, 12, 20, 9))]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    sequences = [batch.add(p, params) for p in prompts]
    passes = []
    real = target.forward_batch

    def spy(rows):
        passes.append([(len(r.tokens), r.num_logits) for r in rows if len(r.tokens) > 1 or r.num_logits == 0])
        return real(rows)

    monkeypatch.setattr(target, "forward_batch", spy)
    got = {s.request_id: [] for s in sequences}
    first_token_order = []
    while batch.running:
        for output in batch.step():
            if not got[output.request_id]:
                first_token_order.append([s.request_id for s in sequences].index(output.request_id))
            got[output.request_id] += output.tokens
    # 9 first (the others age by 9), then 12, then 20 in its two chunks (aged below 30's remaining), then 30.
    assert passes[:6] == [[(9, 1)], [(12, 1)], [(16, 0)], [(4, 1)], [(16, 0)], [(14, 1)]]
    assert first_token_order == [3, 1, 2, 0]
    for sequence, prompt in zip(sequences, prompts):
        assert got[sequence.request_id] == plain_engine(target).generate(prompt, params).tokens


def test_a_long_prompt_is_not_starved_by_short_arrivals():
    """Short prompts keep arriving while a long one waits: shortest-first alone would never serve it; aging serves
    it once the rows prefilled for others reach its own length, and it finishes while the short ones still come."""
    target = PrefixLM(vocab=12, seed=13, max_context=512)
    batch = BatchEngine(target, None, SpecConfig(drafter="none"), max_running=2, prefill_chunk=16)
    long_prompt = [(i * 5) % 12 for i in range(40)]
    long = batch.add(long_prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    short_rows = 0
    steps = 0
    long_began_after = None
    while not long.finished:
        if batch.has_room:
            batch.add([1, 2, 3, 4, 5], SamplingParams(max_tokens=1, ignore_eos=True))  # ends at its first token
        before = long.prefilled
        prefilled_short = sum(len(s.prompt) - s.prefilled for s in batch.running if s is not long and s.prefilling)
        batch.step()
        steps += 1
        if long.prefilled > before and long_began_after is None:
            long_began_after = short_rows
        if long.prefilled == before:
            short_rows += prefilled_short
        assert steps < 100
    assert long_began_after is not None and long_began_after <= len(long_prompt)


def test_abort_frees_the_slot_at_the_step_boundary_and_keeps_the_cache_consistent():
    target = PrefixLM(vocab=12, seed=9, max_context=128)
    draft = PrefixLM(vocab=12, seed=10, scale=0.5, base=target, max_context=128)
    drafter, spec = spec_pieces(target, draft)
    batch = BatchEngine(target, drafter, spec, max_running=2)
    a = batch.add([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    b = batch.add([3, 2, 1], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        batch.step()
    assert not batch.has_room
    batch.abort(a)
    assert a.finish_reason == "abort" and batch.has_room and batch.running == [b]
    assert a.slot.cache.length == len(a.context) - 1  # kept for a next request that shares the prefix
    c = batch.add([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    assert c.slot is a.slot and c.stats.num_cached_prompt_tokens == 2  # the slot with the longest shared prefix
    results = {}
    while batch.running:
        for output in batch.step():
            results.setdefault(output.request_id, []).extend(output.tokens)
    assert results[c.request_id] == plain_engine(target).generate([1, 2, 3], SamplingParams(
        max_tokens=5, ignore_eos=True)).tokens


def test_a_failing_drafter_ends_only_its_sequence():
    target = PrefixLM(vocab=12, seed=9, max_context=128)
    drafter, spec = spec_pieces(target, None, drafter="prompt_lookup")
    batch = BatchEngine(target, drafter, spec, max_running=2)
    good = batch.add([1, 2, 1, 2, 1, 2], SamplingParams(max_tokens=8, ignore_eos=True))
    bad = batch.add([5, 6, 5, 6, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True))

    def broken(context, k):
        raise RuntimeError("drafter broke")

    bad.slot.drafter.propose = broken
    bad.slot.drafter.next_source = lambda context: "x"
    errors = []
    while bad.prefilling:  # the prefill steps: nothing drafted for it yet
        errors += [o for o in batch.step() if o.error is not None]
    errors += [o for o in batch.step() if o.error is not None]
    assert [o.request_id for o in errors] == [bad.request_id] and bad.finish_reason == "error"
    assert str(errors[0].error) == "drafter broke"
    while batch.running:
        batch.step()
    assert good.finish_reason == "length"


def test_one_request_engine_is_the_batch_of_one():
    """SpeculativeEngine runs on a one-slot BatchEngine; a second stream opened while the first is unread ends the
    first one (it yields nothing more) and runs correctly."""
    target = PrefixLM(vocab=12, seed=2, max_context=128)
    engine = plain_engine(target)
    assert isinstance(engine.batch, BatchEngine) and engine.batch.max_running == 1
    first = engine.stream([1, 2], SamplingParams(max_tokens=10, ignore_eos=True))
    next(first)
    second = engine.generate([3, 4], SamplingParams(max_tokens=6, ignore_eos=True))
    assert second.tokens == plain_engine(target).generate([3, 4], SamplingParams(max_tokens=6, ignore_eos=True)).tokens
    assert list(first) == []


def test_load_aware_policy_drafts_where_rows_are_cheap_and_not_where_they_are_dear():
    """Beside three other sequences (three rows, three tokens a pass), the policy maximises the shared pass's tokens
    per second on the measured curve: on a curve flat up to 8 rows (a GPU) it drafts, on a linear one (a
    compute-bound CPU, where a draft row costs a full one) plain wins."""
    flat = {1: 1.0, 8: 1.05, 16: 1.1, 64: 2.0}
    linear = {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 16: 16.0}
    for curve, drafts_beside_others in ((flat, True), (linear, False)):
        policy = AdaptiveK(max_k=6, pass_costs=curve, explore_every=0)
        for _ in range(20):
            policy.update(4, 3, 1e-4, 0.0)  # acceptance 3/4 of 4, cheap drafter, shared passes only
        policy.other_rows, policy.other_tokens = 3, 3.0
        assert (policy.best_k() > 0) == drafts_beside_others, (curve, policy.snapshot())
        assert policy.verify_cost(2) == pytest.approx(np.interp(5, sorted(curve), [curve[s] for s in sorted(curve)]))


def test_measured_shared_passes_override_the_calibrated_curve():
    """The calibration prices a draft row beside others as nearly free (flat curve); the engine's own decode-only
    passes of several sequences say a row costs a full one: the policy stops drafting on the measured price."""
    flat = {1: 1.0, 8: 1.05, 16: 1.1, 64: 2.0}
    policy = AdaptiveK(max_k=6, pass_costs=flat, explore_every=0)
    for _ in range(20):
        policy.update(4, 3, 1e-4, 0.0)
    policy.other_rows, policy.other_tokens = 3, 3.0
    assert policy.best_k() > 0  # on the calibration alone
    policy.shared_pass_costs = {rows: Ewma(0.1, value=float(rows), count=5) for rows in range(4, 11)}
    assert policy.verify_cost(2) == pytest.approx(5.0)
    assert policy.best_k() == 0


def test_the_engine_records_decode_only_shared_passes_by_row_count():
    """What the policy reads: a running mean of seconds per row count, from passes of 2+ decoding sequences only
    (a prefill chunk or a lone sequence says nothing about a shared decode pass)."""
    target = PrefixLM(vocab=12, seed=12, max_context=256)
    batch = BatchEngine(target, None, SpecConfig(drafter="none"), max_running=2, prefill_chunk=4)
    batch.add([1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=6, ignore_eos=True))
    batch.add([3, 1], SamplingParams(max_tokens=10, ignore_eos=True))
    while batch.running:
        batch.step()
    assert set(batch.shared_pass_costs) == {2}  # one row each for two decoding sequences; prefill passes left out
    assert batch.shared_pass_costs[2].count >= 3 and batch.shared_pass_costs[2].value > 0
    batch._record_shared_pass(2, 1.0)
    assert batch.shared_pass_costs[2].value < 1.0 and batch.shared_pass_costs[2].count >= 4


class CountingPasses:
    """Wraps a backend with a native forward_batch that counts passes (one per call), as llama.cpp has."""

    def __init__(self, backend):
        self._backend = backend
        self.passes = 0

    def forward_batch(self, batch):
        from specdec.backends.base import forward_batch

        self.passes += 1
        results = []
        for rows in batch:  # one "pass" over every entry (each computed by the wrapped backend)
            results += forward_batch(self._backend, [rows])
        return results

    def __getattr__(self, name):
        return getattr(self._backend, name)


def test_draft_model_drafts_for_all_sequences_in_shared_passes():
    """Three sequences drafting k=3 with one draft model: each round of drafting is one draft pass for all of them
    (about k passes a step, not 3 * k), and the outputs are still each sequence's solo output."""
    target = PrefixLM(vocab=12, seed=3, max_context=128)
    draft = CountingPasses(PrefixLM(vocab=12, seed=4, scale=0.5, base=target, max_context=128))
    drafter, spec = spec_pieces(target, draft)
    batch = BatchEngine(target, drafter, spec, max_running=3)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    sequences = [batch.add(p, params) for p in PROMPTS[:3]]
    tokens = {s.request_id: [] for s in sequences}
    for output in batch.step():  # the prefill step (a one-token prompt already decodes)
        tokens[output.request_id] += output.tokens
    steps = checked = 0
    while batch.running:
        before = draft.passes
        drafting = sum(1 for s in batch.running if not s.prefilling)
        for output in batch.step():
            tokens[output.request_id] += output.tokens
        steps += 1
        if drafting == 3 and steps > 1:
            assert draft.passes - before <= 3 + 1, draft.passes - before  # k forwards (+ a catch-up), shared
            checked += 1
    assert checked >= 3
    for sequence in sequences:
        solo_drafter, solo_spec = spec_pieces(target, draft)
        want = SpeculativeEngine(target, solo_drafter, solo_spec).generate(sequence.prompt, params).tokens
        assert tokens[sequence.request_id] == want


def use_llamacpp_pass_shaping(target) -> None:
    """Give a fake target the llama.cpp backend's own rules for prefilling apart and fitting a chunk in one call."""
    for rule in ("prefills_apart", "prompt_rows_beside"):
        setattr(target, rule, types.MethodType(getattr(LlamaCppBackend, rule), target))


@pytest.mark.parametrize("exact,apart", [(False, 0), (True, 0), (False, 14)])
def test_fast_mode_fits_a_prompt_chunk_and_the_decode_rows_in_one_call(monkeypatch, exact, apart):
    """Fast mode shortens a prompt chunk by the decode rows beside it, so the pass is one call of batch_size rows
    (not a full chunk and a second call for a few rows); exact mode keeps whole chunks. Outputs are unchanged."""
    target = PrefixLM(vocab=12, seed=8, max_context=512)
    target.batch_size, target.batch_invariant = 16, exact
    target.apart_prefill_rows = apart  # chunks this long are prefilled in a context of their own: no fitting
    use_llamacpp_pass_shaping(target)
    batch = BatchEngine(target, None, SpecConfig(drafter="none"), max_running=3, prefill_chunk=16)
    runners = [batch.add([1, 2], SamplingParams(max_tokens=60, ignore_eos=True)),
               batch.add([3], SamplingParams(max_tokens=60, ignore_eos=True))]
    batch.step()
    batch.step()
    passes = []
    real = target.forward_batch

    def spy(rows):
        passes.append((sum(len(r.tokens) for r in rows), [len(r.tokens) for r in rows if r.num_logits <= 1 and len(r.tokens) > 1]))
        return real(rows)

    monkeypatch.setattr(target, "forward_batch", spy)
    long_prompt = [(i * 7) % 12 for i in range(100)]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    newcomer = batch.add(long_prompt, params)
    tokens = []
    while newcomer.prefilling:
        tokens += [t for o in batch.step() if o.request_id == newcomer.request_id for t in o.tokens]
    chunks = [c[0] for _, c in passes if c]
    assert sum(chunks) == 100
    if exact or apart:
        assert chunks == [16] * 6 + [4] and max(rows for rows, _ in passes) == 18
    else:
        assert chunks == [14] * 7 + [2] and max(rows for rows, _ in passes) == 16
    while not newcomer.finished:
        tokens += [t for o in batch.step() if o.request_id == newcomer.request_id for t in o.tokens]
    assert tokens == plain_engine(target).generate(long_prompt, params).tokens
    assert not any(r.finished for r in runners)


def _fast_engine_prefilling_apart(apart_rows: int, max_running: int):
    """A fast-mode engine of 16-row prompt chunks whose target prefills chunks of apart_rows or more apart (the
    llama.cpp backend's rule), without a drafter."""
    target = PrefixLM(vocab=12, seed=8, max_context=512)
    target.batch_size, target.batch_invariant = 16, False
    target.apart_prefill_rows = apart_rows
    use_llamacpp_pass_shaping(target)
    return target, BatchEngine(target, None, SpecConfig(drafter="none"), max_running=max_running, prefill_chunk=16)


def test_a_prompts_last_chunk_prefilled_apart_goes_ahead_of_the_decoding_streams():
    """A last prompt chunk that the backend prefills in a context of its own runs in a step of its own (its first
    token out after the chunk alone), the decoding streams' pass in the next step, which takes no prompt chunk;
    earlier chunks, short last chunks and steps with nobody decoding are as before. Outputs are unchanged."""
    target, batch = _fast_engine_prefilling_apart(apart_rows=10, max_running=4)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    runners = [batch.add([1, 2], params), batch.add([3], params)]
    tokens = {s.request_id: [] for s in runners}

    def step():
        out = batch.step()
        for o in out:
            tokens.setdefault(o.request_id, []).extend(o.tokens)
        return {o.request_id for o in out}

    step()
    step()
    long_prompt = [(i * 5) % 12 for i in range(28)]  # chunks of 16 and 12 rows: both prefilled apart
    waiting = [(i * 3) % 12 for i in range(11)]  # one chunk of 11 rows (shorter: first), apart: goes ahead too
    newcomer = batch.add(long_prompt, params)
    assert step() == {r.request_id for r in runners}  # the first chunk (not the last) beside the streams
    assert newcomer.prefilled == 16
    later = batch.add(waiting, params)
    assert later.prefilling
    assert step() == {later.request_id}  # shortest first: its only chunk, alone; the first token comes out
    assert newcomer.prefilled == 16 and not later.prefilling
    assert step() == {r.request_id for r in runners} | {later.request_id}  # the streams' pass, no prompt chunk
    assert newcomer.prefilled == 16
    assert step() == {newcomer.request_id}  # its last chunk, alone
    assert step() == {r.request_id for r in runners} | {later.request_id, newcomer.request_id}
    while batch.running:
        step()
    for sequence in (*runners, newcomer, later):
        assert tokens[sequence.request_id] == plain_engine(target).generate(sequence.prompt, params).tokens


def test_a_short_last_chunk_still_shares_the_streams_pass():
    """Negative control: a last chunk below apart_prefill_rows shares the pass (one call) and its step."""
    target, batch = _fast_engine_prefilling_apart(apart_rows=14, max_running=3)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    runner = batch.add([1, 2], params)
    batch.step()
    newcomer = batch.add([(i * 5) % 12 for i in range(12)], params)
    assert {o.request_id for o in batch.step()} == {runner.request_id, newcomer.request_id}
