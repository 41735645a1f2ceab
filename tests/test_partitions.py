"""Cache partitions: a request reuses cross-request state (the slots' cached prefixes, the suffix cache, the adaptive
policies' acceptance) only where its own partition (a tenant and its salt) left it; within a partition the reuse
stays. Negative controls: the same partition does reuse, so the checks can see a leak."""

from __future__ import annotations

import torch

from markov_backend import MarkovBackend
from specdec.config import SamplingParams, SpecConfig
from specdec.drafters import create_drafter
from specdec.engine.scheduler import BatchEngine

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def _target(seed: int = 0) -> MarkovBackend:
    return MarkovBackend(torch.randn(32, 32, generator=torch.Generator().manual_seed(seed)) * 4, max_context=512)


def _engine(target, max_running: int = 1, suffix_cache: bool = True) -> BatchEngine:
    spec = SpecConfig(drafter="suffix", k_policy="adaptive", num_speculative_tokens=8, suffix_cache=suffix_cache)
    return BatchEngine(target, create_drafter("suffix", spec=spec), spec, max_running=max_running)


def _run(engine: BatchEngine, prompt, partition=None):
    sequence = engine.add(prompt, GREEDY, partition=partition)
    tokens = []
    while not sequence.finished:
        for output in engine.step():
            assert output.error is None, output.error
            if output.request_id == sequence.request_id:
                tokens += output.tokens
    return tokens, sequence.stats


SECRET = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]


def test_another_partitions_cached_prefix_is_never_reused():
    for max_running in (1, 2):
        engine = _engine(_target(), max_running)
        _run(engine, SECRET, partition=("victim", None))
        _, attacker = _run(engine, SECRET, partition=("attacker", None))
        assert attacker.num_cached_prompt_tokens == 0, max_running
        # Negative control: the victim's own repeat reuses its prefix (with 2 slots its slot survived the attacker).
        _, again = _run(engine, SECRET, partition=("victim", None))
        if max_running == 2:
            assert again.num_cached_prompt_tokens == len(SECRET) - 1
        _, repeat = _run(engine, SECRET, partition=("victim", None))
        assert repeat.num_cached_prompt_tokens == len(SECRET) - 1


def test_a_salt_narrows_sharing_within_a_tenant():
    engine = _engine(_target())
    _run(engine, SECRET, partition=("t", "salt-a"))
    assert _run(engine, SECRET, partition=("t", "salt-b"))[1].num_cached_prompt_tokens == 0
    assert _run(engine, SECRET, partition=("t", "salt-b"))[1].num_cached_prompt_tokens == len(SECRET) - 1


def test_the_suffix_cache_drafts_only_from_the_own_partitions_outputs():
    engine = _engine(_target(1))
    drafter = engine.drafter
    seen = []  # the cross-request cache tokens each request can draft from, at its begin
    begin = drafter.begin

    def recording_begin(*args, **kwargs):
        seen.append(drafter.cache.num_tokens)
        return begin(*args, **kwargs)

    drafter.begin = recording_begin
    prompt = [7, 2, 9]
    first, _ = _run(engine, prompt, partition="a")
    other, _ = _run(engine, prompt, partition="b")
    same, same_stats = _run(engine, prompt, partition="a")
    assert other == same == first  # greedy: the text never depends on what was drafted
    assert seen[0] == 0 and seen[1] == 0  # b sees nothing of a's output
    assert seen[2] == len(first)  # negative control: a sees its own output
    assert same_stats.num_accepted_tokens > 0


def test_greedy_output_is_the_same_with_and_without_another_partitions_traffic():
    prompt = [5, 6, 7, 8]
    quiet = _run(_engine(_target(2)), prompt, partition="b")[0]
    busy = _engine(_target(2), max_running=2)
    for i in range(3):
        _run(busy, [5, 6, 7, 8, i], partition="a")
    assert _run(busy, prompt, partition="b")[0] == quiet


def test_without_partitions_everything_is_shared_as_before():
    engine = _engine(_target())
    _run(engine, SECRET)
    assert _run(engine, SECRET)[1].num_cached_prompt_tokens == len(SECRET) - 1
