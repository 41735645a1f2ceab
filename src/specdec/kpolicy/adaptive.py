"""AdaptiveK: choose each step's draft length k in [0, max_k] to maximise expected tokens per second under measured acceptance and costs.

The cost model is Leviathan et al.'s, with every term measured online instead of assumed:

    rate(k) = E[tokens | k] / (k * draft_cost + verify_cost(k + 1))

- E[tokens | k] = 1 + sum_{j=1..k} prod_{i<j} a_i, where a_i = P(draft position i is accepted |
  the verifier reached position i). With a_i = a for all i this is (1 - a^(k+1)) / (1 - a).
  A step that proposed n tokens and had m accepted tells us positions 0..m-1 were accepted and,
  if m < n, position m was rejected; positions after m were never looked at and teach nothing.
- draft_cost is the drafter's seconds per proposed token (exponentially weighted).
- verify_cost(s) is the target's seconds for one forward over s = k + 1 tokens: an exponentially
  weighted mean per size. For a size not yet seen it reads the backend's measured pass-cost curve
  (calibration.py) when there is one, scaled to the level this engine measures at the sizes it has
  seen; without a curve, a least-squares line (slope >= 0) through the sizes seen, flat ("verifying
  costs one forward") while one size is known, and never cheaper than the smallest measured size
  for sizes below it, so unmeasured sizes are not chosen on a guess.
- k = 0 is a plain decoding step (rate 1 / verify_cost(1)); it wins when drafts are mostly rejected,
  the drafter is too slow to pay for itself, or verifying extra rows costs nearly as much as decoding
  them (compute-bound CPUs). The second step is a plain one, so that cost is measured early.

Every estimate is a decayed sum, so old evidence fades and the policy follows shifts in acceptance
(e.g. the prompt stops being copied); at each new request the acceptance evidence is halved and the
exploration backoff restarts (begin_request), since acceptance belongs to the content. A position's evidence fades only on steps that drafted it (new
evidence could have arrived), and a position with little evidence borrows its predecessor's rate.
Every `explore_every` steps it tries the best k +/- 1 so the neighbouring estimates do not go stale;
while drafting is off (best k = 0) each exploration that confirms k = 0 doubles the wait before the next
(up to `max_explore_every`), because there exploring costs most: a draft model first has to catch up
on every token decoded since it last ran. When even perfect acceptance could not make drafting pay at
the measured costs, it does not explore at all. Decisions are a pure function of the updates it was fed:
no random numbers and no clock of its own, so it is unit-testable with synthetic timings.

Learning from plans (learns_from_plans, set by the engine for deterministic drafters such as the suffix trie
and prompt lookup): acceptance evidence comes from plan_ledger.PlanLedger, which scores the draft the drafter
would propose at the largest k against the tokens that really follow, at every step, through observe(). Such a
policy never drafts to explore (acceptance is observed without drafting, costs come from the measured curve),
starts with plain steps instead of prior_k, update() keeps only the timings, and a draft must promise PLAN_MARGIN
more than plain decoding (what it picks is where its estimates came out high).

Continuous batching (other_rows, other_tokens set per step by the scheduler): when other sequences
share the target pass, rate(k) is the pass's: (other_tokens + E[tokens | k]) / c(other_rows + k + 1) on
the measured curve, so a draft row is bought at its marginal cost in that pass only if it yields tokens
faster than the pass already does (load-aware: less drafting on a CPU's steep curve as load grows).
Where the engine has measured decode-only passes of several sequences at a row count
(`shared_pass_costs`), that measurement replaces the calibrated curve there: one sequence's rows,
which the calibration times, can cost less than the same number of rows from many sequences.
A policy that learns from plans (allocatable) is not asked alone in a shared pass: the scheduler chooses every
such sequence's k together (row_allocation.py) from position_gains() and shared_pass_curve(), and take_k() records it.

Note: in sampled mode the emitted text is exactly target-distributed whatever k is chosen, but the
k sequence depends on wall-clock measurements, so the same seed reproduces the same text only with
the fixed or heuristic policies (greedy output never depends on k).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Mapping

from specdec.kpolicy.base import KPolicy
from specdec.kpolicy.calibration import cost_table, interpolate_cost

# Plan-scored acceptance (plan_ledger.py). Evidence arrives at every step, drafted or not, so it can fade slower
# than a drafted step's (0.95: the last ~20 plans) and outlive the request (a new request used to halve it so
# that drafting would be retried; a plan learner never needs to retry). A quarter of a pseudo-rejection per
# position keeps a few copies in chat from buying a long verification, where a 32-row pass costs 13 one-row
# passes. Measured in-engine on the default pair, 2 threads, 18 chat and 6 code prompts, the drafting steps
# priced on the calibrated curve: net decode time saved on chat -1.6 s before (drafting to explore), -0.85 s
# with plans at the drafted-step settings (0.85, 0, halved per request), -0.03 s with these; on code +10.8,
# +10.4, +10.2 s (doubt 1: chat +0.2, code +7.4-8.9).
PLAN_DECAY = 0.95
PLAN_DOUBT = 0.25
PLAN_CARRY = 1.0
# Winner's curse: the policy drafts where its acceptance estimate came out high, so the drafts it picks are, on
# average, accepted less than it expected; a draft must promise 10% more than plain decoding. Measured in-engine on
# the 2-vCPU AMX Xeon (2 threads, prompts 4-6 of six weak chat categories and of code_edit / HumanEval, each
# drafting step priced on the engine's own passes): chat drafting saved +16.3 s without the margin, +17.0 s with it
# (reasoning -0.26 -> +0.05 s, stem -0.08 -> +0.36 s), with 26% fewer drafting steps; code +34.1 -> +34.6 s.
PLAN_MARGIN = 0.10


@dataclass
class Ewma:
    """Exponentially weighted mean that is the plain mean while it has fewer than 1/alpha samples."""

    alpha: float
    value: float = 0.0
    count: int = 0

    def add(self, x: float) -> None:
        self.count += 1
        weight = max(self.alpha, 1.0 / self.count)
        self.value += weight * (x - self.value)


class AdaptiveK(KPolicy):
    """Per-request draft-length policy driven by a measured cost model (see the module docstring).

    max_k:         the largest k ever proposed (SpecConfig.num_speculative_tokens).
    prior_k:       k used until the first measurement arrives (default min(4, max_k)).
    decay:         each step that drafts position i multiplies that position's old evidence by this
                   (0.85 ~ the last 7 such steps); positions not drafted keep theirs until explored.
    time_alpha:    EWMA weight of a new timing sample.
    shrink:        pseudo-observations pulling each position's rate toward its predecessor's (position 0:
                   toward the pooled rate), so a rarely reached position borrows strength from the others.
    explore_every: every this many decisions, try best k + 1 or - 1 (alternating); 0 disables.
    max_explore_every: the longest wait between explorations while best k = 0 (see the module docstring).
    pass_costs:    the target's measured seconds per pass by row count (calibration.measure_pass_costs), or None.
    """

    def __init__(
        self,
        max_k: int,
        prior_k: int | None = None,
        decay: float = 0.85,
        time_alpha: float = 0.2,
        shrink: float = 1.0,
        explore_every: int = 8,
        prior_acceptance: float = 0.5,
        max_explore_every: int = 128,
        pass_costs: Mapping[int, float] | None = None,
    ):
        if max_k < 0:
            raise ValueError(f"max_k must be >= 0, got {max_k}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.max_k = max_k
        self.pass_costs = dict(pass_costs) if pass_costs else None
        self.prior_k = min(4, max_k) if prior_k is None else max(0, min(prior_k, max_k))
        self.decay = decay
        self.time_alpha = time_alpha
        self.shrink = shrink
        self.explore_every = explore_every
        self.max_explore_every = max(explore_every, max_explore_every)
        self._explore_wait = explore_every  # current wait between explorations (grows while best k = 0)
        self._since_explore = 0
        self._explored_from: int | None = None  # the best k when the last exploration was made
        self.prior_acceptance = prior_acceptance
        # Decayed counts: position i reached by the verifier / accepted there.
        self._reached = [0.0] * max_k
        self._accepted = [0.0] * max_k
        self._draft_cost = Ewma(time_alpha)  # seconds per proposed token
        self._verify: dict[int, Ewma] = {}  # tokens verified (k + 1) -> seconds per target forward
        self._explore_up = True
        self.last_k = self.prior_k
        self.history: list[int] = []  # every k returned, for reports and tests
        # Continuous batching: the rows other sequences put in the same target pass, and the tokens those rows
        # are expected to emit (one per decoding sequence). With a measured curve the policy then maximises the
        # pass's tokens per second: a draft row pays only if what it adds beats what the pass already yields
        # per second (load-aware: see verify_cost).
        self.other_rows = 0
        self.other_tokens = 0.0  # both set per step by set_pass_context
        # What shared passes of each row count really cost on this engine (seconds per pass, kept by the
        # scheduler from its own decode-only passes): the calibration measures one sequence's rows, and several
        # sequences' rows of the same count can cost more (measured: 15 ms a draft row beside 8 sequences where
        # the calibrated curve said 5). Measured counts override the curve in shared passes.
        self.shared_pass_costs: Mapping[int, Ewma] = {}
        # Set by the engine when acceptance evidence arrives through observe() (plan_ledger) instead of update().
        self.learns_from_plans = False
        self.plan_decay = decay  # observe()'s fading per new observation
        self.request_carry = 0.5  # how much acceptance evidence a new request keeps (begin_request)
        self.doubt = 0.0  # pseudo-rejections per position: evidence must outweigh them before long drafts look sure
        self.margin = 0.0  # a draft must beat plain decoding's expected rate by this fraction (best_k, PLAN_MARGIN)

    # ----- learning -------------------------------------------------------------------------

    def update(self, num_proposed: int, num_accepted: int, draft_seconds: float, target_seconds: float,
               catchup_seconds: float = 0.0) -> None:
        """Feed one engine step: draft length, accepted prefix length, and the time each side took.

        A drafter's one-off catch-up (a draft model first reading the prompt) is left out of the
        per-token drafting cost, except on a step that explored drafting while k = 0 was best: that
        exploration is what made the catch-up happen, so it is charged, and a drafter that is slow to
        bring back into play stops being explored.
        """
        if self._explored_from == 0:
            draft_seconds += catchup_seconds
        num_proposed = max(0, min(num_proposed, self.max_k))
        num_accepted = max(0, min(num_accepted, num_proposed))
        if target_seconds > 0:
            self._verify.setdefault(num_proposed + 1, Ewma(self.time_alpha)).add(target_seconds)
        if num_proposed == 0:
            return  # a plain step (or an empty draft) says nothing about acceptance
        self._draft_cost.add(max(draft_seconds, 0.0) / num_proposed)
        if self.learns_from_plans:
            return  # the plan behind this draft is scored through observe(), every position it reached
        for i in range(num_proposed):
            self._reached[i] *= self.decay
            self._accepted[i] *= self.decay
        for i in range(num_accepted):
            self._reached[i] += 1.0
            self._accepted[i] += 1.0
        if num_accepted < num_proposed:
            self._reached[num_accepted] += 1.0  # the first rejection; later positions were never looked at

    can_learn_from_plans = True

    def set_pass_context(self, other_rows: int, other_tokens: float) -> None:
        """The rows other sequences put in this step's pass, and the tokens they are expected to emit."""
        self.other_rows, self.other_tokens = other_rows, other_tokens

    def learn_from_plans(self) -> None:
        """Take acceptance from observe() (plan_ledger) from now on, with the plan settings (PLAN_*); idempotent."""
        if not self.learns_from_plans:
            self.learns_from_plans = True
            self.plan_decay, self.doubt, self.request_carry = PLAN_DECAY, PLAN_DOUBT, PLAN_CARRY
            self.margin = PLAN_MARGIN

    def observe(self, position: int, accepted: bool) -> None:
        """One scored plan position (plan_ledger): position reached, and accepted or not. Like update(), a
        position's old evidence fades by `decay` each time new evidence arrives for it."""
        if 0 <= position < self.max_k:
            self._reached[position] = self._reached[position] * self.plan_decay + 1.0
            self._accepted[position] = self._accepted[position] * self.plan_decay + (1.0 if accepted else 0.0)

    # ----- estimates ----------------------------------------------------------------------------

    @property
    def acceptance_rate(self) -> float:
        """Overall P(accept | reached), pooled over positions (the prior before any draft)."""
        reached = sum(self._reached)
        if reached < 1e-9:
            return self.prior_acceptance
        return sum(self._accepted) / reached

    def acceptance_per_pos(self) -> list[float]:
        """a_i for i in [0, max_k): each position's own rate, shrunk toward the position before it.

        Position 0 is shrunk toward the pooled rate; a rarely reached later position inherits its
        predecessor's rate, so stale evidence there cannot keep long drafts alive after acceptance drops.
        """
        rates: list[float] = []
        anchor = self.acceptance_rate
        for acc, reached in zip(self._accepted, self._reached):
            anchor = (acc + self.shrink * anchor) / (reached + self.shrink + self.doubt)
            rates.append(anchor)
        return rates

    def expected_tokens(self, k: int, rates: list[float] | None = None) -> float:
        """E[tokens emitted by one step with a k-token draft] (accepted + the recovered/bonus token)."""
        rates = self.acceptance_per_pos() if rates is None else rates
        total, survive = 1.0, 1.0
        for i in range(k):
            survive *= rates[i]
            total += survive
        return total

    @property
    def draft_cost(self) -> float:
        """Measured seconds per drafted token (0 before any draft)."""
        return self._draft_cost.value

    def verify_cost(self, size: int, level: float | None = None) -> float:
        """Seconds for one target forward over `size` tokens: measured, else a line through the measured sizes.

        Beside other sequences' rows (other_rows > 0) and with a measured curve, the whole shared pass:
        c(other_rows + size), so that expected_rate compares the pass's tokens per second with and without this
        sequence's draft, and a draft row is worth its marginal cost c(o + k + 1) - c(o + 1) only when it
        yields tokens faster than the pass already does: more drafting where rows are nearly free (a GPU's
        flat curve), none where every row costs a full one (a compute-bound CPU).
        """
        if self.pass_costs:
            return self._curve_costs([size], self._curve_level() if level is None else level)[0]
        seen = self._verify.get(size)
        if seen is not None and seen.count > 0:
            return seen.value
        points = [(s, e.value) for s, e in self._verify.items() if e.count > 0]
        if not points:
            return 1.0  # no measurement yet: only ratios matter, and k=prior until measured
        points.sort()
        if size < points[0][0]:
            return points[0][1]  # never extrapolate a size below the smallest seen to be cheaper
        if len(points) == 1:
            return points[0][1]  # one size seen: verifying more tokens costs about one forward
        n = len(points)
        mean_s = sum(s for s, _ in points) / n
        mean_t = sum(t for _, t in points) / n
        var = sum((s - mean_s) ** 2 for s, _ in points)
        slope = max(sum((s - mean_s) * (t - mean_t) for s, t in points) / var, 0.0)
        fitted = mean_t + slope * (size - mean_s)
        return max(fitted, 1e-9)

    def shared_pass_curve(self, level: float | None = None) -> dict[int, float]:
        """Seconds of a pass shared with other sequences, by row count: the calibrated curve at this engine's level,
        replaced by the engine's own decode-only shared passes where it has measured that row count."""
        if not self.pass_costs:
            raise ValueError("no measured pass-cost curve")
        level = self._curve_level() if level is None else level
        curve = {n: c * level for n, c in self.pass_costs.items()}
        curve.update((rows, seen.value) for rows, seen in self.shared_pass_costs.items())
        return curve

    def position_gains(self, k_max: int) -> list[float]:
        """Expected tokens the j-th draft row adds, j = 1..k_max: P(draft tokens 1..j all accepted)."""
        gains, survive = [], 1.0
        for rate in self.acceptance_per_pos()[: max(0, k_max)]:
            survive *= rate
            gains.append(survive)
        return gains

    @property
    def allocatable(self) -> bool:
        """Whether the scheduler may choose this policy's k together with other sequences' (row_allocation): its
        acceptance comes from plans, so it never needs to draft to explore, and a measured curve prices rows."""
        return self.learns_from_plans and bool(self.pass_costs)

    def take_k(self, k: int) -> int:
        """Record this step's k: next_k's own choice, or one made for this policy from outside (the scheduler's
        joint allocation)."""
        self.last_k = k
        self.history.append(k)
        return k

    def _curve_level(self) -> float:
        """The measured curve's scale at the level this engine pays (its steps carry verification and Python too)."""
        points = [(s, e.value) for s, e in self._verify.items() if e.count > 0]
        return statistics.median(t / interpolate_cost(self.pass_costs, s) for s, t in points) if points else 1.0

    def expected_rate(self, k: int, rates: list[float] | None = None) -> float:
        """Expected tokens per second when proposing k tokens this step (of the whole pass, when shared)."""
        return self._rates(rates)[k]

    def _rates(self, rates: list[float] | None = None) -> list[float]:
        """expected_rate(k) for every k in [0, max_k], in one pass (E[tokens | k] accumulated, the curve's
        level computed once): the policy decides every step, so this stays linear in max_k."""
        rates = self.acceptance_per_pos() if rates is None else rates
        shared = self.other_tokens if self.other_rows > 0 and self.pass_costs else 0.0
        verify = self._verify_costs()
        draft_cost = self.draft_cost
        out: list[float] = []
        expected, survive = 1.0, 1.0
        for k in range(self.max_k + 1):
            if k:
                survive *= rates[k - 1]
                expected += survive
            cost = k * draft_cost + verify[k]
            out.append((shared + expected) / cost if cost > 0 else float("inf"))
        return out

    def _verify_costs(self) -> list[float]:
        """verify_cost(k + 1) for every k in [0, max_k], with the curve's level, the shared curve and its sort done
        once (verify_cost alone redoes them for each size: 33 times a step at k up to 32)."""
        sizes = list(range(1, self.max_k + 2))
        if not self.pass_costs:
            return [self.verify_cost(size) for size in sizes]
        return self._curve_costs(sizes, self._curve_level())

    def _curve_costs(self, sizes: list[int], level: float) -> list[float]:
        """With a measured curve, verify_cost of each size (the one rule; verify_cost and _verify_costs read it):
        the whole shared pass beside other sequences' rows, else the size's own timing where this engine has one,
        else the curve at the engine's level. The curve is sorted once for all sizes (cost_table)."""
        if self.other_rows > 0:
            return cost_table(self.shared_pass_curve(level), [self.other_rows + size for size in sizes])
        costs = []
        for size, interpolated in zip(sizes, cost_table(self.pass_costs, sizes)):
            seen = self._verify.get(size)
            costs.append(seen.value if seen is not None and seen.count > 0 else interpolated * level)
        return costs

    def best_k(self) -> int:
        """argmax_k expected_rate(k) over [0, max_k] (ties go to the smaller k); a k >= 1 must also beat plain
        decoding's rate by the fraction `margin`."""
        rates = self._rates()
        best, best_rate = 0, rates[0] * (1 + self.margin)
        for k, rate in enumerate(rates[1:], start=1):
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = k, rate
        return best

    # ----- deciding -----------------------------------------------------------------------------

    def next_k(self) -> int:
        curve_priced = self.other_rows > 0 and bool(self.pass_costs)  # shared passes: rows priced on the curve
        if self.learns_from_plans:
            # Acceptance arrives from plans whatever k is, so nothing is drafted to explore: plain steps until a
            # plain step's cost is measured (or the curve prices this pass), then the best k.
            k = self.best_k() if curve_priced or 1 in self._verify else 0
        elif not curve_priced and (not self._verify or self._draft_cost.count == 0):
            k = self.prior_k  # nothing measured yet (in a shared pass the curve prices rows from the start)
        elif 1 not in self._verify and not curve_priced:
            # One plain step, once: its cost is what every draft must beat, and sizes below the smallest
            # measured one are never extrapolated to be cheaper, so k = 0 could not be found otherwise.
            k = 0
        else:
            k = self.best_k()
            if self._explored_from is not None:
                confirmed_off = k == 0 and self._explored_from == 0
                self._explore_wait = min(2 * self._explore_wait, self.max_explore_every) if confirmed_off \
                    else self.explore_every
                self._explored_from = None
            self._since_explore += 1
            worth_exploring = k > 0 or self.drafting_could_pay()
            if self.explore_every and worth_exploring and self._since_explore >= self._explore_wait and self.max_k > 0:
                self._explored_from = k
                self._since_explore = 0
                k = self._neighbour(k)
        return self.take_k(k)

    def begin_request(self, carry: float | None = None) -> None:
        """A new request: its content decides acceptance (a code edit copies, a poem does not), so the evidence
        from earlier requests counts `carry` as much, and the exploration backoff restarts, so a copy-heavy
        request after many where drafting did not pay is found within it. Costs stay: they are the hardware's."""
        carry = self.request_carry if carry is None else carry
        self._reached = [r * carry for r in self._reached]
        self._accepted = [a * carry for a in self._accepted]
        self._explore_wait = self.explore_every
        self._since_explore = 0

    def drafting_could_pay(self, margin: float = 0.05) -> bool:
        """Would some k >= 1 beat plain decoding by `margin` even if every draft token were accepted?

        If not, the measured costs alone (drafting + verifying extra rows) rule drafting out, and exploring
        it would only spend time: acceptance cannot rise above 1.
        """
        rates = self._rates([1.0] * self.max_k)
        return any(rate > (1 + margin) * rates[0] for rate in rates[1:])

    def _neighbour(self, k: int) -> int:
        step = 1 if self._explore_up else -1
        self._explore_up = not self._explore_up
        candidate = k + step
        if not 0 <= candidate <= self.max_k:
            candidate = k - step
        return max(0, min(candidate, self.max_k))

    def snapshot(self) -> dict:
        """The current estimates, for logs and reports."""
        return {
            "acceptance_rate": round(self.acceptance_rate, 4),
            "acceptance_per_pos": [round(a, 4) for a in self.acceptance_per_pos()],
            "draft_cost_s": self.draft_cost,
            "verify_cost_s": {s: e.value for s, e in sorted(self._verify.items())},
            "best_k": self.best_k(),
        }


__all__ = ["AdaptiveK"]
