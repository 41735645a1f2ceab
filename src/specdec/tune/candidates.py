"""What `specdec tune` measures: draft sources (model references or loaded backends), drafters and k policies,
expanded into the bench Methods that run them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdec.bench.method.methods import Method
from specdec.config import ConfigError, SpecConfig, adaptive_max_k

# Drafters that read a draft model; prompt lookup and the suffix drafter need none.
MODEL_DRAFTERS = ("draft_model", "hybrid")
DRAFTERS = ("draft_model", "prompt_lookup", "suffix", "hybrid")
K_POLICIES = ("fixed", "adaptive", "heuristic")
DEFAULT_DRAFTERS = DRAFTERS
DEFAULT_K_POLICIES = ("fixed", "adaptive")
DEFAULT_K_SWEEP = (2, 4)
# Without --repeats, each prompt is repeated until every configuration has this many paired runs with plain
# decoding: enough for a confidence interval that is not all noise (t at 4 degrees of freedom is 2.78; at 1, 12.7).
MIN_PAIRED_RUNS = 5


@dataclass(frozen=True)
class DraftCandidate:
    """One candidate draft model: what the user typed, the reference written to the config, and/or a loaded backend.

    With `backend` None the reference is loaded (and released) when its turn comes.
    """

    label: str
    reference: str | None = None
    backend: object | None = None


@dataclass(frozen=True)
class PolicyChoice:
    """A k policy with its k: the fixed draft length, the adaptive maximum, or the heuristic's start."""

    policy: str
    k: int

    @property
    def label(self) -> str:
        return {"fixed": f"fixed k={self.k}", "adaptive": f"adaptive k≤{self.k}",
                "heuristic": f"heuristic from k={self.k}"}[self.policy]


@dataclass(frozen=True)
class TuneOptions:
    """Which drafters and k policies to try, on what decoding, and when drafting counts as helping."""

    drafters: tuple[str, ...] = DEFAULT_DRAFTERS
    k_policies: tuple[str, ...] = DEFAULT_K_POLICIES
    k_sweep: tuple[int, ...] = DEFAULT_K_SWEEP  # k values of the fixed policy
    k_max: int | None = None  # the adaptive policy's maximum; None: what generate uses (config.adaptive_max_k)
    on_cuda: bool = False  # where the target runs (the default maximum depends on it)
    heuristic_k: int = 5  # the heuristic policy's starting k
    draft_p_min: float = 0.0
    # A configuration is recommended only if the confidence interval of its paired speedup lies above 1
    # (intervals.py) and its paired speedup reaches min_speedup: a real but 1.01x gain is not worth a config.
    min_speedup: float = 1.03
    confidence: float = 0.95  # of the speedup intervals

    def __post_init__(self) -> None:
        object.__setattr__(self, "drafters", parse_drafters(self.drafters))
        object.__setattr__(self, "k_policies", parse_policies(self.k_policies))
        if not self.k_sweep or any(not 1 <= k <= 64 for k in self.k_sweep):
            raise ConfigError(f"fixed k values must be integers in [1, 64], got {self.k_sweep!r}")
        for name, k in (("k_max", self.k_max), ("heuristic_k", self.heuristic_k)):
            if k is not None and not 1 <= k <= 64:
                raise ConfigError(f"{name} must be in [1, 64], got {k}")
        if not self.min_speedup > 0:
            raise ConfigError(f"min_speedup must be > 0, got {self.min_speedup}")
        if not 0.5 <= self.confidence < 1:
            raise ConfigError(f"confidence must be in [0.5, 1), got {self.confidence}")

    def policies(self, drafter: str = "draft_model") -> list[PolicyChoice]:
        out: list[PolicyChoice] = []
        for policy in self.k_policies:
            if policy == "fixed":
                out += [PolicyChoice("fixed", k) for k in self.k_sweep]
            elif policy == "adaptive":
                out.append(PolicyChoice("adaptive", self.k_max or adaptive_max_k(drafter, self.on_cuda)))
            else:
                out.append(PolicyChoice("heuristic", self.heuristic_k))
        return out


def _names(value: str | Sequence[str]) -> list[str]:
    items = value.split(",") if isinstance(value, str) else list(value)
    return list(dict.fromkeys(item.strip() for item in items if item and item.strip()))


def _choose(value: str | Sequence[str], allowed: Sequence[str], what: str) -> tuple[str, ...]:
    names = _names(value)
    if not names:
        raise ConfigError(f"no {what} given; choose from {', '.join(allowed)}")
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise ConfigError(f"unknown {what} {unknown[0]!r}; choose from {', '.join(allowed)}")
    return tuple(names)


def parse_drafters(value: str | Sequence[str]) -> tuple[str, ...]:
    """'draft_model,prompt_lookup' -> ('draft_model', 'prompt_lookup'); unknown names are a ConfigError."""
    return _choose(value, DRAFTERS, "drafter")


def parse_policies(value: str | Sequence[str]) -> tuple[str, ...]:
    """'fixed,adaptive' -> ('fixed', 'adaptive'); unknown names are a ConfigError."""
    return _choose(value, K_POLICIES, "k policy")


def parse_drafts(value: str | Sequence[str] | None, target: str) -> list[DraftCandidate]:
    """--drafts 'a,b' -> candidates; 'default' is the packaged 0.5B draft. None: the default draft for the
    default target, else no draft model (model-free drafters only)."""
    if value is None:
        names = ["default"] if target in ("default", "default-target") else []
    else:
        names = _names(value)
    return [DraftCandidate(name, "default-draft" if name == "default" else name) for name in names]


def method_name(drafter: str, choice: PolicyChoice) -> str:
    """A unique, readable name inside one measuring run (the bench tables key their rows by it)."""
    return f"{drafter} {choice.label}"


def candidate_method(drafter: str, choice: PolicyChoice, options: TuneOptions) -> Method:
    """The bench Method that runs `drafter` under one k policy on our engine (same fields bench sets)."""
    spec = SpecConfig(num_speculative_tokens=choice.k, drafter=drafter, k_policy=choice.policy,
                      draft_p_min=options.draft_p_min)
    return Method(
        method_name(drafter, choice), "specdec", f"{drafter}, {choice.label}", spec=spec, k=choice.k,
        fixed_k=choice.policy == "fixed", needs_draft_model=drafter in MODEL_DRAFTERS,
        uses_draft_model=drafter == "draft_model",
    )


def methods_for(drafters: Sequence[str], options: TuneOptions) -> list[Method]:
    return [candidate_method(d, choice, options) for d in drafters for choice in options.policies(d)]


__all__ = [
    "DEFAULT_DRAFTERS", "DEFAULT_K_POLICIES", "DEFAULT_K_SWEEP", "DRAFTERS", "K_POLICIES", "MIN_PAIRED_RUNS",
    "MODEL_DRAFTERS",
    "DraftCandidate", "PolicyChoice", "TuneOptions", "candidate_method", "method_name", "methods_for",
    "parse_drafters", "parse_drafts", "parse_policies",
]
