"""The decoding methods a benchmark compares, parsed from --methods and checked against what is installed.

Ours (same engine, same loaded weights): `plain` (no drafter: the baseline), `spec_k<K>` (draft model,
fixed k; the family name `spec` expands to --k-sweep), `adaptive` and `heuristic` (k chosen per step),
`prompt_lookup` (n-gram copy from the context, no model), `suffix` (suffix trie over the context and
recent outputs, draft length from the match), `hybrid` (lookup first, draft model otherwise).
The peer, transformers' own generate on the very same nn.Modules: `hf_plain` (greedy/sampled generate),
`hf_assisted` (assisted generation with transformers' defaults), `hf_assisted_k<K>` (constant K
assistant tokens, confidence stopping off; family `hf_assisted_k` expands to --k-sweep) and
`hf_prompt_lookup` (prompt_lookup_num_tokens=-k).
`prompt_lookup_adaptive`, `suffix_adaptive` and `hybrid_adaptive` choose k per step with the cost model (max --k-max);
without --k-max each takes what `generate` uses (config.adaptive_max_k: 32 for the copying drafters);
`<one of them>_k<K>` (e.g. `suffix_adaptive_k16`) sets that maximum for the one method, so maxima compare in one run.
The other peer, llama.cpp's own llama-server on the same GGUF files (bench/llamacpp_peer.py):
`llamacpp_plain`, `llamacpp_spec` (its draft-model speculation, default settings; `llamacpp_spec_k<K>`
sets its draft length) and `llamacpp_ngram` (its n-gram speculation).
`exact_<method>` is any of our methods on a second target loaded with llama.cpp's exact (batch-invariant)
kernels, what `--exact` runs (`exact_plain`: plain decoding with them, the exact methods' baseline); see
bench/method/exact.py.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, replace

from specdec.config import ConfigError, SpecConfig, adaptive_max_k
from specdec.drafters import available_drafters

DEFAULT_METHODS = (
    "plain", "spec", "adaptive", "heuristic", "prompt_lookup", "prompt_lookup_adaptive", "hybrid", "hybrid_adaptive",
    "hf_plain", "hf_assisted", "hf_prompt_lookup", "llamacpp_plain", "llamacpp_spec", "llamacpp_ngram",
)
FAMILIES = (
    "plain", "spec", "spec_k<K>", "adaptive", "heuristic", "prompt_lookup", "prompt_lookup_adaptive", "suffix",
    "suffix_adaptive", "hybrid", "hybrid_adaptive", "<drafter>_adaptive_k<K>", "hf_plain", "hf_assisted", "hf_assisted_k", "hf_assisted_k<K>", "hf_prompt_lookup",
    "llamacpp_plain", "llamacpp_spec", "llamacpp_spec_k<K>", "llamacpp_ngram", "exact_<one of ours>",
)
# Each peer framework's own plain decoding: its speculative methods are also compared with it.
PEER_BASELINES = {"hf": "hf_plain", "llamacpp": "llamacpp_plain"}
# Our methods on the exact kernels (--exact) carry this prefix; exact_plain is their baseline.
EXACT_PREFIX = "exact_"
EXACT_BASELINE = EXACT_PREFIX + "plain"
BASELINES = ("plain", *PEER_BASELINES.values(), EXACT_BASELINE)
_SPEC_K = re.compile(r"^spec_k(\d+)$")
_HF_K = re.compile(r"^hf_assisted_k(\d+)$")
_LLAMACPP_K = re.compile(r"^llamacpp_spec_k(\d+)$")
_ADAPTIVE_K = re.compile(r"^(prompt_lookup|suffix|hybrid)_adaptive_k(\d+)$")


@dataclass(frozen=True)
class Method:
    """One way of decoding; `spec` is set for our engine (drafter 'none' = plain), `hf_mode` for transformers."""

    name: str
    kind: str  # "specdec", "hf" (transformers) or "llamacpp" (llama-server)
    description: str
    spec: SpecConfig | None = None
    hf_mode: str | None = None  # "plain", "assisted" or "prompt_lookup"
    hf_num_assistant_tokens: int | None = None  # None: transformers' defaults
    hf_lookup_tokens: int | None = None
    hf_lookup_ngram: int | None = None
    k: int | None = None  # nominal draft length (the maximum for adaptive policies)
    fixed_k: bool = False
    needs_draft_model: bool = False
    uses_draft_model: bool = False  # cost ratio from draft-model forwards (else from drafting time per token)
    requires: str | None = None  # module that must import for the method to exist
    llamacpp_mode: str | None = None  # "plain", "spec" or "ngram"
    llamacpp_draft_max: int | None = None  # llama-server --spec-draft-n-max (None: its default)
    exact: bool = False  # runs on the target loaded with the exact kernels (--exact), not the default ones

    @property
    def baseline(self) -> str:
        return EXACT_BASELINE if self.exact else PEER_BASELINES.get(self.kind, "plain")

    @property
    def is_plain(self) -> bool:
        return self.name in BASELINES

    def to_dict(self) -> dict:
        out = {
            "name": self.name, "kind": self.kind, "description": self.description, "k": self.k,
            "fixed_k": self.fixed_k, "baseline": self.baseline, "uses_draft_model": self.uses_draft_model,
            "exact": self.exact,
        }
        if self.spec is not None:
            out["spec"] = {
                "drafter": self.spec.drafter, "num_speculative_tokens": self.spec.num_speculative_tokens,
                "k_policy": self.spec.k_policy, "draft_p_min": self.spec.draft_p_min,
                "lookup_min_ngram": self.spec.lookup_min_ngram, "lookup_max_ngram": self.spec.lookup_max_ngram,
            }
        if self.llamacpp_mode is not None:
            out["llamacpp"] = {"mode": self.llamacpp_mode, "spec_draft_n_max": self.llamacpp_draft_max}
        if self.hf_mode is not None:
            out["hf"] = {
                "mode": self.hf_mode, "num_assistant_tokens": self.hf_num_assistant_tokens,
                "prompt_lookup_num_tokens": self.hf_lookup_tokens, "max_matching_ngram_size": self.hf_lookup_ngram,
            }
        return out


@dataclass(frozen=True)
class MethodOptions:
    k_sweep: tuple[int, ...] = (2, 4, 6)
    k: int = 5  # heuristic start, prompt_lookup, hybrid, hf_prompt_lookup
    k_max: int | None = None  # adaptive's maximum; None: what generate uses (config.adaptive_max_k)
    on_cuda: bool = False  # where the target runs (adaptive_max_k depends on it)
    draft_p_min: float = 0.0

    def adaptive_max_k(self, drafter: str) -> int:
        return self.k_max if self.k_max is not None else adaptive_max_k(drafter, self.on_cuda)


def parse_k_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"--k-sweep must be comma-separated integers, got {text!r}") from None
    if not values or any(not 1 <= v <= 64 for v in values):
        raise ConfigError(f"--k-sweep values must be integers in [1, 64], got {text!r}")
    return tuple(dict.fromkeys(values))


def _spec_method(name: str, description: str, options: MethodOptions, **spec_kwargs) -> Method:
    spec = SpecConfig(draft_p_min=options.draft_p_min, **spec_kwargs)
    drafter = spec.drafter
    policy = spec.k_policy
    return Method(
        name, "specdec", description, spec=spec, k=spec.num_speculative_tokens, fixed_k=policy == "fixed",
        needs_draft_model=drafter in ("draft_model", "hybrid"), uses_draft_model=drafter == "draft_model",
        requires={"adaptive": "specdec.kpolicy.adaptive"}.get(policy) or (
            f"specdec.drafters.{drafter}" if drafter in ("prompt_lookup", "suffix", "hybrid") else None
        ),
    )


def _k_of(name: str, match: re.Match) -> int:
    k = int(match.group(1))
    if not 1 <= k <= 64:
        raise ConfigError(f"method {name!r}: k must be in [1, 64]")
    return k


def expand_method(name: str, options: MethodOptions) -> list[Method]:
    """One --methods entry to the Method objects it stands for; ConfigError for unknown names."""
    if name.startswith(EXACT_PREFIX):
        return _exact_methods(name, options)
    if name == "plain":
        return [Method("plain", "specdec", "our engine, no drafter (baseline)", spec=SpecConfig(drafter="none"))]
    if name == "spec":
        return [m for k in options.k_sweep for m in expand_method(f"spec_k{k}", options)]
    if match := _SPEC_K.match(name):
        k = _k_of(name, match)
        return [_spec_method(name, f"draft model, fixed k={k}", options, drafter="draft_model",
                             num_speculative_tokens=k)]
    if name == "adaptive":
        max_k = options.adaptive_max_k("draft_model")
        return [_spec_method(name, f"draft model, adaptive k (cost model, max {max_k})", options,
                             drafter="draft_model", num_speculative_tokens=max_k, k_policy="adaptive")]
    if name == "heuristic":
        return [_spec_method(name, f"draft model, heuristic k (+2/-1, start {options.k})", options,
                             drafter="draft_model", num_speculative_tokens=options.k, k_policy="heuristic")]
    if name == "prompt_lookup":
        return [_spec_method(name, f"n-gram prompt lookup, k={options.k}", options, drafter="prompt_lookup",
                             num_speculative_tokens=options.k)]
    if name == "hybrid":
        return [_spec_method(name, f"prompt lookup, else draft model, k={options.k}", options, drafter="hybrid",
                             num_speculative_tokens=options.k)]
    if name == "suffix":
        return [_spec_method(name, f"suffix trie (prompt, output, recent outputs), at most k={options.k}", options,
                             drafter="suffix", num_speculative_tokens=options.k)]
    adaptive_k = _ADAPTIVE_K.match(name)
    if name in ("prompt_lookup_adaptive", "suffix_adaptive", "hybrid_adaptive") or adaptive_k:
        drafter = adaptive_k.group(1) if adaptive_k else name.removesuffix("_adaptive")
        max_k = int(adaptive_k.group(2)) if adaptive_k else options.adaptive_max_k(drafter)
        if not 1 <= max_k <= 64:
            raise ConfigError(f"method {name!r}: k must be in [1, 64]")
        what = {"prompt_lookup": "n-gram prompt lookup", "suffix": "suffix trie",
                "hybrid": "prompt lookup, else draft model"}[drafter]
        return [_spec_method(name, f"{what}, adaptive k per source (max {max_k})", options,
                             drafter=drafter, num_speculative_tokens=max_k, k_policy="adaptive")]
    if name == "llamacpp_plain":
        return [Method(name, "llamacpp", "llama.cpp's llama-server, target only (llama.cpp baseline)",
                       llamacpp_mode="plain")]
    if name == "llamacpp_spec":
        return [Method(name, "llamacpp", "llama-server --spec-type draft-simple, its default settings",
                       llamacpp_mode="spec", needs_draft_model=True, uses_draft_model=True)]
    if match := _LLAMACPP_K.match(name):
        k = _k_of(name, match)
        return [Method(name, "llamacpp", f"llama-server --spec-type draft-simple --spec-draft-n-max {k}",
                       llamacpp_mode="spec", llamacpp_draft_max=k, k=k, needs_draft_model=True,
                       uses_draft_model=True)]
    if name == "llamacpp_ngram":
        return [Method(name, "llamacpp", "llama-server --spec-type ngram-simple, its default settings",
                       llamacpp_mode="ngram")]
    if name == "hf_plain":
        return [Method("hf_plain", "hf", "transformers generate, target only (HF baseline)", hf_mode="plain")]
    if name == "hf_assisted":
        return [Method("hf_assisted", "hf", "transformers assisted generation, its default settings",
                       hf_mode="assisted", needs_draft_model=True, uses_draft_model=True)]
    if name == "hf_assisted_k":
        return [m for k in options.k_sweep for m in expand_method(f"hf_assisted_k{k}", options)]
    if match := _HF_K.match(name):
        k = _k_of(name, match)
        return [Method(name, "hf", f"transformers assisted generation, constant k={k}", hf_mode="assisted",
                       hf_num_assistant_tokens=k, k=k, fixed_k=True, needs_draft_model=True, uses_draft_model=True)]
    if name == "hf_prompt_lookup":
        ngram = SpecConfig().lookup_max_ngram
        return [Method(name, "hf", f"transformers prompt lookup, k={options.k}, max n-gram {ngram}",
                       hf_mode="prompt_lookup", hf_lookup_tokens=options.k, hf_lookup_ngram=ngram, k=options.k,
                       fixed_k=True)]
    raise ConfigError(f"unknown method {name!r}; choose from {', '.join(FAMILIES)} (K an integer)")


def _exact_methods(name: str, options: MethodOptions) -> list[Method]:
    """exact_<m>: our method m (a family expands: exact_spec -> exact_spec_k2, ...) on the exact kernels."""
    inner = name[len(EXACT_PREFIX):]
    hint = "exact_ takes one of our engine's methods (exact_plain, exact_adaptive, exact_spec_k4, ...)"
    try:
        members = expand_method(inner, options) if not inner.startswith(EXACT_PREFIX) else None
    except ConfigError:
        members = None
    if not members:
        raise ConfigError(f"unknown method {name!r}; {hint}")
    if any(m.kind != "specdec" for m in members):
        raise ConfigError(f"method {name!r}: {hint}, not transformers' or llama-server's (they have no exact mode)")
    return [
        replace(m, name=EXACT_PREFIX + m.name, exact=True,
                description=(f"{m.description.removesuffix(' (baseline)')}, exact kernels (--exact)"
                             + (" (baseline of the exact_ methods)" if m.name == "plain" else "")))
        for m in members
    ]


def unavailable_reason(
    method: Method, has_draft_model: bool, has_hf_model: bool = True, llamacpp_missing: str | None = None,
    llamacpp_draft_missing: str | None = None, exact_missing: str | None = None,
) -> str | None:
    """Why a method cannot run here (missing module, no draft model, not transformers, no llama-server).

    llamacpp_missing: why no llama.cpp peer can run (no binaries, target not GGUF); llamacpp_draft_missing:
    why its draft-model speculation cannot (the draft is not a GGUF file); exact_missing: why the exact_
    methods cannot (bench/method/exact.py: not the llama.cpp backend, or its target already exact).
    """
    if method.exact and exact_missing:
        return exact_missing
    if method.requires:
        try:
            importlib.import_module(method.requires)
        except ImportError as exc:
            return f"{method.requires} is not available ({exc})"
        if method.spec is not None and method.spec.drafter not in ("none", "draft_model"):
            if method.spec.drafter not in available_drafters():
                return f"drafter {method.spec.drafter!r} is not registered"
    if method.needs_draft_model and not has_draft_model:
        return "needs a draft model (--draft)"
    if method.kind == "hf" and not has_hf_model:
        return "the backend is not a transformers model"
    if method.kind == "llamacpp" and llamacpp_missing:
        return llamacpp_missing
    if method.kind == "llamacpp" and method.needs_draft_model and llamacpp_draft_missing:
        return llamacpp_draft_missing
    return None


def resolve_methods(
    text: str | None, options: MethodOptions, has_draft_model: bool | None = None, has_hf_model: bool = True,
    llamacpp_missing: str | None = None, llamacpp_draft_missing: str | None = None,
    exact_missing: str | None = None,
) -> tuple[list[Method], dict[str, str]]:
    """Parse --methods (None = the default set) into runnable methods plus {skipped name: reason}.

    Baselines are added when missing: `plain` always (every speedup is relative to it), a peer's own
    plain decoding (`hf_plain`, `llamacpp_plain`) whenever one of its speculative methods is selected, and
    `exact_plain` whenever an exact_ method is.
    Explicitly requested methods that cannot run are an error; unavailable members of the default set are
    skipped and reported. With has_draft_model=None only names are checked (before any model is loaded).
    """
    explicit = text is not None
    names = [n.strip() for n in (text or ",".join(DEFAULT_METHODS)).split(",") if n.strip()]
    if not names:
        raise ConfigError("--methods is empty; choose from " + ", ".join(FAMILIES))
    methods: list[Method] = []
    for name in names:
        methods += expand_method(name, options)
    if not any(m.name == "plain" for m in methods):
        methods.insert(0, expand_method("plain", options)[0])
    for kind, baseline in PEER_BASELINES.items():
        if any(m.kind == kind and not m.is_plain for m in methods) and not any(m.name == baseline for m in methods):
            methods.append(expand_method(baseline, options)[0])
    if any(m.exact for m in methods) and not any(m.name == EXACT_BASELINE for m in methods):
        methods.append(expand_method(EXACT_BASELINE, options)[0])
    unique = list({m.name: m for m in methods}.values())
    if has_draft_model is None:
        return unique, {}
    runnable, skipped = [], {}
    for method in unique:
        reason = unavailable_reason(method, has_draft_model, has_hf_model, llamacpp_missing,
                                    llamacpp_draft_missing, exact_missing)
        if reason is None:
            runnable.append(method)
        elif explicit and method.name in names or explicit and _family_requested(method.name, names):
            raise ConfigError(f"method {method.name!r} cannot run: {reason}")
        else:
            skipped[method.name] = reason
    return runnable, skipped


def _family_requested(name: str, names: list[str]) -> bool:
    if any(n.startswith("llamacpp_") for n in names) and name == "llamacpp_plain":
        return True  # the baseline of an explicitly requested llama.cpp method
    if name.startswith(EXACT_PREFIX):
        exact = [n[len(EXACT_PREFIX):] for n in names if n.startswith(EXACT_PREFIX)]
        return bool(exact) and (name == EXACT_BASELINE or _family_requested(name[len(EXACT_PREFIX):], exact))
    return (name.startswith("spec_k") and "spec" in names) or (
        name.startswith("hf_assisted_k") and "hf_assisted_k" in names
    )


__all__ = [
    "BASELINES", "DEFAULT_METHODS", "EXACT_BASELINE", "EXACT_PREFIX", "FAMILIES", "PEER_BASELINES", "Method",
    "MethodOptions", "expand_method", "parse_k_list", "resolve_methods", "unavailable_reason",
]
