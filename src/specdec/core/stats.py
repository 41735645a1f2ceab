"""SpecStats: plain counters for speculative decoding and the rates derived from them (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counters for one request or many (merge). mean_acceptance_length includes the bonus token."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_drafts_per_pos: list[int] = field(default_factory=list)  # drafts that reached position i
    num_target_forwards: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0
    # Prompt tokens the target cache already held from the previous request (prefix reuse): not prefilled.
    num_cached_prompt_tokens: int = 0
    # Tokens a grammar forced ahead of a step's draft (not drafted: kept out of the drafter's counters).
    num_forced_tokens: int = 0
    num_forced_accepted_tokens: int = 0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0

    def record_step(self, num_proposed: int, num_accepted: int) -> None:
        self.num_target_forwards += 1
        if num_proposed == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        _grow(self.num_accepted_tokens_per_pos, num_proposed)
        _grow(self.num_drafts_per_pos, num_proposed)
        for i in range(num_proposed):
            self.num_drafts_per_pos[i] += 1
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    def record_forced(self, num_forced: int, num_accepted: int) -> None:
        """Tokens a grammar forced at the head of a step's draft (record_step counts the step and the drafter's)."""
        self.num_forced_tokens += num_forced
        self.num_forced_accepted_tokens += num_accepted

    def merge(self, other: "SpecStats") -> "SpecStats":
        for name in (
            "num_forced_tokens", "num_forced_accepted_tokens",
            "num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_target_forwards",
            "num_generated_tokens", "num_prompt_tokens", "num_cached_prompt_tokens", "draft_seconds", "target_seconds",
            "prefill_seconds", "total_seconds",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in (
            (self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos),
            (self.num_drafts_per_pos, other.num_drafts_per_pos),
        ):
            _grow(mine, len(theirs))
            for i, value in enumerate(theirs):
                mine[i] += value
        return self

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens per verification including the bonus (plain decoding = 1.0)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """P(position i accepted | a draft reached position i)."""
        return [
            acc / reached if reached else 0.0
            for acc, reached in zip(self.num_accepted_tokens_per_pos, self.num_drafts_per_pos)
        ]

    @property
    def decode_seconds(self) -> float:
        return max(self.total_seconds - self.prefill_seconds, 0.0)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens / wall time of the request (prefill included)."""
        return self.num_generated_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "acceptance_rate_per_pos": [round(x, 4) for x in self.acceptance_rate_per_pos],
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "num_target_forwards": self.num_target_forwards,
            "num_generated_tokens": self.num_generated_tokens,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_cached_prompt_tokens": self.num_cached_prompt_tokens,
            "num_forced_tokens": self.num_forced_tokens,
            "num_forced_accepted_tokens": self.num_forced_accepted_tokens,
            "draft_seconds": round(self.draft_seconds, 4),
            "target_seconds": round(self.target_seconds, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "total_seconds": round(self.total_seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
        }


def _grow(values: list[int], size: int) -> None:
    if len(values) < size:
        values.extend([0] * (size - len(values)))


def expected_tokens_per_step(acceptance_rate: float, k: int) -> float:
    """Leviathan et al.: E[tokens per target pass] = (1 - a^(k+1)) / (1 - a)."""
    a = min(max(acceptance_rate, 0.0), 1.0)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def leviathan_speedup(acceptance_rate: float, k: int, cost_ratio: float, verify_cost: float = 1.0) -> float:
    """Expected speedup over plain decoding; verify_cost = one (k+1)-token target pass / one 1-token pass.

    Leviathan et al. assume verify_cost = 1 (memory-bound hardware); on a compute-bound CPU a pass over
    k+1 tokens costs several one-token passes, and the measured ratio gives the bound that applies there.
    """
    return expected_tokens_per_step(acceptance_rate, k) / (k * cost_ratio + verify_cost)
