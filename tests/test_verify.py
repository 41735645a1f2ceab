"""The acceptance rules: greedy unit tests, and statistical proof that rejection sampling emits the target's distribution.

The statistical tests simulate speculative decoding on a small vocabulary with no model at all: a
"target" and a "draft" are tables of next-token distributions that depend on the position and on
the previous token (so a wrong row, a wrong residual or a skipped rejection all show up). Draft
tokens are sampled from q, verify_sampled decides, and the loop continues until two tokens were
emitted. The empirical distribution of the first token, and of the first two tokens jointly, must
match the exact target distribution (chi-square p > 1e-3 and a total-variation bound). Negative
controls run deliberately wrong rules through the same check and must be rejected by it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.core.sampling import sample_token
from specdec.core.verify import Verdict, verify_greedy, verify_sampled

V = 6
START = V  # "previous token" index used for the first position
N_DRAWS = 20_000  # for generic p/q pairs
N_DRAWS_ADVERSARIAL = 6_000
N_DRAWS_CONTROL = 3_000  # wrong rules fail by hundreds of standard deviations
TV_FIRST, TV_JOINT = 0.025, 0.05


# ---------------------------------------------------------------------------------------------
# verify_greedy


def test_greedy_all_accepted_gives_bonus():
    verdict = verify_greedy([4, 7, 1], [4, 7, 1, 9])
    assert verdict == Verdict(num_accepted=3, next_token=9, is_bonus=True)


@pytest.mark.parametrize("mismatch_at", [0, 1, 2])
def test_greedy_first_mismatch_gives_recovered_target_token(mismatch_at):
    draft = [4, 7, 1]
    target = [4, 7, 1, 9]
    target[mismatch_at] = 50 + mismatch_at
    # Positions after the first mismatch must not matter, even if they match again.
    verdict = verify_greedy(draft, target)
    assert verdict == Verdict(num_accepted=mismatch_at, next_token=50 + mismatch_at, is_bonus=False)


def test_greedy_later_match_after_mismatch_is_not_accepted():
    verdict = verify_greedy([1, 2, 3], [1, 5, 3, 8])
    assert (verdict.num_accepted, verdict.next_token, verdict.is_bonus) == (1, 5, False)


def test_greedy_k0_emits_target_token():
    assert verify_greedy([], [11]) == Verdict(0, 11, True)


def test_greedy_accepts_tensors_and_rejects_wrong_length():
    verdict = verify_greedy(torch.tensor([2, 3]), torch.tensor([2, 3, 4]))
    assert verdict == Verdict(2, 4, True) and isinstance(verdict.next_token, int)
    with pytest.raises(ValueError, match="k \\+ 1"):
        verify_greedy([1, 2], [1, 2])


def test_sampled_shape_errors():
    p = torch.full((3, V), 1.0 / V)
    with pytest.raises(ValueError, match="target rows"):
        verify_sampled([0, 1, 2], None, p, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="draft rows"):
        verify_sampled([0, 1], p[:1], p, torch.Generator().manual_seed(0))


def test_sampled_k0_samples_bonus_from_the_only_row():
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    verdict = verify_sampled([], None, p, torch.Generator().manual_seed(0))
    assert verdict == Verdict(0, 2, True)


def test_sampled_deterministic_rejection_recovers_from_p_without_x():
    # p puts no mass on the drafted token: it must be rejected, and the recovered token comes from p.
    p = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0, 0.0], [1.0, 0, 0, 0, 0, 0]])
    for seed in range(20):
        verdict = verify_sampled([1], None, p, torch.Generator().manual_seed(seed))
        assert verdict == Verdict(0, 3, False)


def test_sampled_is_reproducible_with_a_seeded_generator():
    rng = np.random.default_rng(0)
    p = torch.tensor(rng.dirichlet(np.ones(V), size=4), dtype=torch.float32)
    q = torch.tensor(rng.dirichlet(np.ones(V), size=3), dtype=torch.float32)
    runs = [
        [verify_sampled([0, 1, 2], q, p, gen) for _ in range(50)]
        for gen in (torch.Generator().manual_seed(7), torch.Generator().manual_seed(7))
    ]
    assert runs[0] == runs[1]


# ---------------------------------------------------------------------------------------------
# Statistical tests


def _dirichlet(rng, alpha=2.0):
    return rng.dirichlet(np.full(V, alpha))


def _support(rng, size):
    return rng.choice(V, size=size, replace=False)


def _on(support, rng, alpha=2.0):
    row = np.zeros(V)
    row[support] = rng.dirichlet(np.full(len(support), alpha))
    return row


def _one_hot(token):
    row = np.zeros(V)
    row[token] = 1.0
    return row


def _pair(kind, rng):
    """One (p_row, q_row) pair of an adversarial kind; q_row None means a deterministic draft token."""
    p = _dirichlet(rng)
    if kind == "random":
        return p, _dirichlet(rng)
    if kind == "equal":
        return p, p.copy()
    if kind == "disjoint":
        support = _support(rng, V // 2)
        rest = np.setdiff1d(np.arange(V), support)
        return _on(support, rng), _on(rest, rng)
    if kind in ("onehot_none", "onehot_matrix"):
        return p, _one_hot(int(rng.integers(V)))
    if kind == "q_zero_where_p_positive":
        return p, _on(_support(rng, 2), rng)
    if kind == "p_onehot":
        return _one_hot(int(rng.integers(V))), _dirichlet(rng)
    if kind == "p_zero_where_q_positive":
        return _on(_support(rng, 3), rng), _dirichlet(rng)
    raise AssertionError(kind)


class Tables:
    """p[pos][prev] and q[pos][prev] next-token distributions, prev in [0, V] (V = start of sequence)."""

    def __init__(self, kind: str, k: int, seed: int):
        rng = np.random.default_rng(seed)
        self.kind = kind
        positions = k + 2  # the second emitted token may need rows up to position 1 + k
        self.p = torch.zeros(positions, V + 1, V, dtype=torch.float64)
        self.q = torch.zeros(positions, V + 1, V, dtype=torch.float64)
        for pos in range(positions):
            for prev in range(V + 1):
                p_row, q_row = _pair(kind, rng)
                self.p[pos, prev] = torch.from_numpy(p_row)
                self.q[pos, prev] = torch.from_numpy(q_row)
        self.p, self.q = self.p.float(), self.q.float()
        self.deterministic = kind == "onehot_none"

    def exact_first(self) -> np.ndarray:
        return self.p[0, START].double().numpy()

    def exact_joint(self) -> np.ndarray:
        first = self.p[0, START].double()
        return (first[:, None] * self.p[1, :V].double()).numpy()  # [t0, t1]


def _always_accept(draft_tokens, draft_probs, target_probs, generator):
    """WRONG: keeps every draft token, so the output follows q."""
    k = len(draft_tokens)
    return Verdict(k, sample_token(target_probs[k], generator), True)


def _resample_from_p(draft_tokens, draft_probs, target_probs, generator):
    """WRONG (a classic bug): accepts with min(1, p/q) but resamples from p instead of norm(max(p - q, 0))."""
    for i, token in enumerate(draft_tokens):
        p_x, q_x = float(target_probs[i, token]), float(draft_probs[i, token])
        if float(torch.rand((), generator=generator)) * q_x < p_x:
            continue
        return Verdict(i, sample_token(target_probs[i], generator), False)
    k = len(draft_tokens)
    return Verdict(k, sample_token(target_probs[k], generator), True)


def simulate(tables: Tables, k: int, draws: int, seed: int, rule=verify_sampled, device: str = "cpu"):
    """Run the speculative loop until two tokens are emitted, `draws` times; count first and first-two tokens.

    Draft tokens are drawn from q with numpy (inverse CDF, fast); the rule gets its own torch generator,
    and its tensors and generator live on `device`.
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    rng = np.random.default_rng(seed)
    first = np.zeros(V, dtype=np.int64)
    joint = np.zeros((V, V), dtype=np.int64)
    accepted_first_step = 0
    positions = tables.p.shape[0]
    p_rows_of = [[tables.p[pos, prev].to(device) for prev in range(V + 1)] for pos in range(positions)]
    q_rows_of = [[tables.q[pos, prev].to(device) for prev in range(V + 1)] for pos in range(positions)]
    q_cdf = np.cumsum(tables.q.double().numpy(), axis=-1)
    q_cdf /= q_cdf[..., -1:]
    for _ in range(draws):
        emitted: list[int] = []
        while len(emitted) < 2:
            pos0 = len(emitted)
            prevs = [emitted[-1] if emitted else START]
            for j in range(k):
                token = int(np.searchsorted(q_cdf[pos0 + j, prevs[-1]], rng.random(), side="right"))
                prevs.append(min(token, V - 1))
            tokens = prevs[1:]
            p_rows = torch.stack([p_rows_of[pos0 + j][prevs[j]] for j in range(k + 1)])
            q = None if tables.deterministic else torch.stack([q_rows_of[pos0 + j][prevs[j]] for j in range(k)])
            verdict = rule(tokens, q, p_rows, generator)
            if pos0 == 0:
                accepted_first_step += verdict.num_accepted
            emitted += tokens[: verdict.num_accepted] + [verdict.next_token]
        first[emitted[0]] += 1
        joint[emitted[0], emitted[1]] += 1
    return first, joint.reshape(-1), accepted_first_step / draws


def distribution_check(observed: np.ndarray, exact: np.ndarray, tv_bound: float) -> tuple[float, float, str]:
    """(chi-square p-value, total variation, problem) for observed counts against exact probabilities.

    problem is non-empty when a token with exact probability 0 was emitted (an immediate failure).
    Cells with small expected counts are pooled so the chi-square approximation holds.
    """
    observed = np.asarray(observed, dtype=np.float64).reshape(-1)
    exact = np.asarray(exact, dtype=np.float64).reshape(-1)
    exact = exact / exact.sum()
    n = observed.sum()
    impossible = (exact <= 1e-12) & (observed > 0)
    problem = f"emitted impossible cells {np.flatnonzero(impossible).tolist()}" if impossible.any() else ""
    tv = 0.5 * np.abs(observed / n - exact).sum()
    expected = exact * n
    big = expected >= 5
    obs_bins = list(observed[big])
    exp_bins = list(expected[big])
    if (~big).any() and expected[~big].sum() > 0:
        obs_bins.append(observed[~big].sum())
        exp_bins.append(expected[~big].sum())
    if len(obs_bins) < 2:
        p_value = 1.0 if not problem and np.allclose(obs_bins, exp_bins) else 0.0
    else:
        p_value = float(chisquare(obs_bins, exp_bins).pvalue)
    return p_value, tv, problem


def assert_matches(observed, exact, tv_bound, label=""):
    p_value, tv, problem = distribution_check(observed, exact, tv_bound)
    assert not problem, f"{label}: {problem}"
    assert p_value > 1e-3, f"{label}: chi-square p={p_value:.2e}, TV={tv:.4f}"
    assert tv < tv_bound, f"{label}: total variation {tv:.4f} >= {tv_bound}"


CASES = [  # (kind, k, draws)
    ("random", 1, N_DRAWS),
    ("random", 2, N_DRAWS),
    ("random", 3, N_DRAWS),
    ("equal", 2, N_DRAWS_ADVERSARIAL),
    ("disjoint", 2, N_DRAWS_ADVERSARIAL),
    ("onehot_none", 1, N_DRAWS_ADVERSARIAL),
    ("onehot_none", 3, N_DRAWS_ADVERSARIAL),
    ("onehot_matrix", 2, N_DRAWS_ADVERSARIAL),
    ("q_zero_where_p_positive", 3, N_DRAWS_ADVERSARIAL),
    ("p_onehot", 2, 2_000),  # the output is deterministic; any deviation is caught at once
    ("p_zero_where_q_positive", 2, N_DRAWS_ADVERSARIAL),
]


@pytest.mark.parametrize("kind,k,draws", CASES, ids=[f"{kind}-k{k}" for kind, k, _ in CASES])
def test_rejection_sampling_emits_the_target_distribution(kind, k, draws):
    tables = Tables(kind, k, seed=100 + k)
    first, joint, accept_rate = simulate(tables, k, draws, seed=k)
    assert_matches(first, tables.exact_first(), tv_bound=TV_FIRST, label=f"{kind} k={k} first token")
    assert_matches(joint, tables.exact_joint(), tv_bound=TV_JOINT, label=f"{kind} k={k} first two tokens")
    if kind == "equal":
        # p == q: min(1, p/q) = 1, every draft token must be accepted.
        assert accept_rate == k
    if kind == "disjoint":
        # q(x) > 0 implies p(x) = 0: nothing can ever be accepted.
        assert accept_rate == 0


@pytest.mark.parametrize("kind", ["random", "disjoint", "q_zero_where_p_positive"])
def test_first_position_acceptance_probability_is_sum_of_min_p_q(kind):
    """P(accept x_0) = sum_x min(p(x), q(x)) (Leviathan et al., beta)."""
    tables = Tables(kind, 1, seed=7)
    beta = float(torch.minimum(tables.p[0, START], tables.q[0, START]).sum())
    generator = torch.Generator().manual_seed(3)
    draws, hits = 6_000, 0
    p_rows = tables.p[:2, START]  # position 1's row is irrelevant for the first decision
    q_rows = tables.q[:1, START]
    for _ in range(draws):
        token = int(torch.multinomial(q_rows[0], 1, generator=generator))
        hits += verify_sampled([token], q_rows, p_rows, generator).num_accepted
    sd = max((beta * (1 - beta) / draws) ** 0.5, 1e-9)
    assert abs(hits / draws - beta) < 5 * sd + 1e-9, (hits / draws, beta)


def test_p_onehot_is_emitted_exactly():
    tables = Tables("p_onehot", 2, seed=11)
    first, joint, _ = simulate(tables, 2, 2_000, seed=0)
    expected_first = int(tables.p[0, START].argmax())
    assert first[expected_first] == 2_000
    expected_second = int(tables.p[1, expected_first].argmax())
    assert joint[expected_first * V + expected_second] == 2_000


@pytest.mark.parametrize(
    "rule,k", [(_always_accept, 1), (_always_accept, 3), (_resample_from_p, 2)],
    ids=["always_accept-k1", "always_accept-k3", "resample_from_p-k2"],
)
def test_negative_control_wrong_rules_are_detected(rule, k):
    """The same check must have power: a wrong acceptance rule is rejected by it."""
    tables = Tables("random", k, seed=100 + k)
    first, joint, _ = simulate(tables, k, N_DRAWS_CONTROL, seed=k, rule=rule)
    p_first, _, _ = distribution_check(first, tables.exact_first(), TV_FIRST)
    p_joint, _, _ = distribution_check(joint, tables.exact_joint(), TV_JOINT)
    assert p_first < 1e-6 or p_joint < 1e-6, (p_first, p_joint)
    with pytest.raises(AssertionError):
        assert_matches(first, tables.exact_first(), tv_bound=TV_FIRST)
        assert_matches(joint, tables.exact_joint(), tv_bound=TV_JOINT)


def test_negative_control_deterministic_draft_without_residual_fix():
    """WRONG: treating a deterministic draft like a sampled one with q = p would accept too often."""

    def wrong(draft_tokens, draft_probs, target_probs, generator):
        k = len(draft_tokens)
        return verify_sampled(draft_tokens, target_probs[:k], target_probs, generator)

    tables = Tables("onehot_none", 1, seed=101)
    first, _, _ = simulate(tables, 1, N_DRAWS_CONTROL, seed=1, rule=wrong)
    p_value, tv, _ = distribution_check(first, tables.exact_first(), TV_FIRST)
    assert p_value < 1e-6 and tv > 0.05


GPU_CASES = [("random", 3, 8_000), ("onehot_none", 2, 8_000), ("disjoint", 2, 4_000)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind,k,draws", GPU_CASES, ids=[f"{kind}-k{k}" for kind, k, _ in GPU_CASES])
def test_rejection_sampling_on_cuda_emits_the_target_distribution(kind, k, draws):
    """The same rule with its tensors and generator on the GPU (one host read per step)."""
    tables = Tables(kind, k, seed=200 + k)
    first, joint, _ = simulate(tables, k, draws, seed=k, device="cuda")
    assert_matches(first, tables.exact_first(), tv_bound=TV_FIRST, label=f"cuda {kind} k={k} first token")
    assert_matches(joint, tables.exact_joint(), tv_bound=TV_JOINT, label=f"cuda {kind} k={k} first two tokens")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_negative_control_on_cuda_always_accepting_is_detected():
    def always_accept(tokens, draft_probs, target_probs, generator):
        from specdec.core.sampling import sample_token

        return Verdict(len(tokens), sample_token(target_probs[len(tokens)], generator), True)

    tables = Tables("random", 2, seed=9)
    first, joint, _ = simulate(tables, 2, 4_000, seed=1, rule=always_accept, device="cuda")
    p_value, tv, problem = distribution_check(joint, tables.exact_joint(), TV_JOINT)
    assert problem or p_value < 1e-6 or tv > TV_JOINT
