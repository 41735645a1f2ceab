"""Frozen, validated configuration types (sampling, speculation, model pair) with a JSON round-trip."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from specdec.errors import ConfigError

WEIGHT_FORMATS = ("fp32", "bf16", "int8")
# Runtimes: "auto" picks llama.cpp for GGUF files (and the default pair) on CPU, torch otherwise.
BACKENDS = ("auto", "torch", "llama.cpp")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. temperature == 0 means greedy (exact argmax path)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1.0 disables
    min_p: float = 0.0  # 0.0 disables
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    # Logits processors (core/penalties.py), applied to the target at every verified row as plain decoding applies
    # them after that row's prefix: OpenAI's presence/frequency penalties (over the output) and logit_bias
    # ((token id, bias) pairs; a dict is accepted), llama.cpp's repetition penalty over the last repeat_last_n
    # tokens of prompt + output (-1: all of them, 0: none).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repeat_last_n: int = 64
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Structured output: a JSON schema (its JSON text) the output must match (grammar/, llguidance), masked at
    # every verified row as plain constrained decoding masks it; {"type": "object"} is OpenAI's JSON mode.
    json_schema: str | None = None
    # The target's log-probability of each returned token and of its `logprobs` most likely alternatives (0-20;
    # None: none are computed), from the verify pass's rows (core/logprobs.py).
    logprobs: int | None = None
    # The target's log-probability of each prompt token after the first (and of its `prompt_logprobs` most likely
    # alternatives, 0-20), from the prefill's rows: completions' echo, what lm-evaluation-harness scores. The
    # prompt is then prefilled whole (no cached prefix has the rows), and max_tokens may be 0 (score only).
    prompt_logprobs: int | None = None
    # Or a grammar in llguidance's Lark dialect (what tool_choice "required" builds: toolcalls/grammar.py).
    lark_grammar: str | None = None

    @property
    def constrained(self) -> bool:
        """Whether a grammar (json_schema or lark_grammar) constrains the output."""
        return self.json_schema is not None or self.lark_grammar is not None

    def __post_init__(self) -> None:
        _check(self.json_schema is None or self.lark_grammar is None, "give json_schema or lark_grammar, not both")
        _check(self.lark_grammar is None or (isinstance(self.lark_grammar, str) and not self.ignore_eos),
               "lark_grammar must be text, and cannot go with ignore_eos (the grammar decides where the text ends)")
        if isinstance(self.json_schema, dict):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except (TypeError, ValueError):
                schema = None
            _check(isinstance(schema, dict), "json_schema must be the JSON text of a JSON object (a JSON schema)")
            _check(not self.ignore_eos, "ignore_eos cannot go with json_schema: the grammar decides where the text ends")
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        elif not isinstance(self.logit_bias, tuple):
            object.__setattr__(self, "logit_bias", tuple(tuple(pair) for pair in self.logit_bias))
        _check(all(isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], int) and pair[0] >= 0
                   and isinstance(pair[1], (int, float)) and (math.isfinite(pair[1]) or pair[1] == -math.inf)
                   for pair in self.logit_bias),
               "logit_bias must map token ids (integers >= 0) to finite numbers (or -inf: the token is banned)")
        _check(len({token for token, _ in self.logit_bias}) == len(self.logit_bias),
               "logit_bias names a token id twice")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and math.isfinite(value) and -2 <= value <= 2,
                   f"{name} must be a number in [-2, 2], got {value!r}")
        _check(isinstance(self.repetition_penalty, (int, float)) and math.isfinite(self.repetition_penalty)
               and self.repetition_penalty > 0, f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
                                         and 0 <= self.logprobs <= 20),
               f"logprobs must be an integer in [0, 20] (the alternatives per token) or None, got {self.logprobs!r}")
        _check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                                and not isinstance(self.prompt_logprobs, bool)
                                                and 0 <= self.prompt_logprobs <= 20),
               f"prompt_logprobs must be an integer in [0, 20] or None, got {self.prompt_logprobs!r}")
        _check(isinstance(self.repeat_last_n, int) and self.repeat_last_n >= -1,
               f"repeat_last_n must be an integer >= -1 (-1: the whole context), got {self.repeat_last_n!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        _check(
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0,
            f"temperature must be a finite number >= 0, got {self.temperature!r}",
        )
        _check(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}")
        _check(
            isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
            f"top_p must be in (0, 1], got {self.top_p!r}",
        )
        _check(
            isinstance(self.min_p, (int, float)) and 0 <= self.min_p < 1,
            f"min_p must be in [0, 1), got {self.min_p!r}",
        )
        _check(
            isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
            and self.max_tokens >= (0 if self.prompt_logprobs is not None else 1),
            f"max_tokens must be an integer >= 1 (0 only with prompt_logprobs), got {self.max_tokens!r}",
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        _check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


COPYING_DRAFTERS = ("suffix", "prompt_lookup")


def adaptive_max_k(drafter: str, on_cuda: bool = False) -> int:
    """The adaptive policy's largest draft when none is given: 32 for the copying drafters, else 16 on CUDA, 5 on a CPU.

    The policy drafts only lengths that pay on the measured pass costs, so the maximum only has to be long
    enough. A copy (code edits, quoted text) is accepted for dozens of tokens, and long verifications are the
    cheap ones per row: on the 2-core EPYC a 33-row pass costs 13 one-row passes, 5 rows cost 3.3
    (benchmarks/long-drafts-2core: code_edit and HumanEval 1.35x of llama.cpp plain at 32, 1.11x at 5). A
    draft model pays for every drafted token, so it keeps 5 on a CPU; on CUDA 17-row passes cost ~1.1
    one-row passes (H200).
    """
    if drafter in COPYING_DRAFTERS:
        return 32
    return 16 if on_cuda else 5


@dataclass(frozen=True)
class SpecConfig:
    """How speculation runs: drafter name, draft length k, and the drafting policy knobs."""

    num_speculative_tokens: int = 5
    drafter: str = "draft_model"
    # Stop drafting once the draft's top probability falls below this (llama.cpp --draft-p-min).
    draft_p_min: float = 0.0
    # Choose k per step from online estimates of acceptance and cost ("fixed", "adaptive", "heuristic").
    k_policy: str = "fixed"
    # Prompt-lookup n-gram sizes (used by lookup drafters).
    lookup_max_ngram: int = 3
    lookup_min_ngram: int = 1
    # Keep the KV cache of the previous request and prefill only what a new prompt adds after the longest
    # common prefix (llama-server's cache_prompt). The exact llama.cpp target never reuses: see engine/single.py (reuses_prefix).
    prefix_cache: bool = True
    # Suffix drafter (drafters/suffix.py): trie depth, the cross-request cache of recent outputs (in memory,
    # bounded by tokens), and vLLM's suffix rules: at most factor * match length + offset tokens, each with
    # an estimated probability >= min_prob.
    suffix_cache: bool = True
    suffix_cache_tokens: int = 8192
    suffix_depth: int = 24
    suffix_max_factor: float = 1.0
    suffix_max_offset: float = 0.0
    suffix_min_prob: float = 0.1

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        _check(isinstance(k, int) and 1 <= k <= 64, f"num_speculative_tokens (k) must be an integer in [1, 64], got {k!r}")
        _check(
            isinstance(self.draft_p_min, (int, float)) and 0 <= self.draft_p_min < 1,
            f"draft_p_min must be in [0, 1), got {self.draft_p_min!r}",
        )
        _check(
            self.k_policy in ("fixed", "adaptive", "heuristic"),
            f"k_policy must be one of fixed, adaptive, heuristic; got {self.k_policy!r}",
        )
        _check(
            1 <= self.lookup_min_ngram <= self.lookup_max_ngram,
            "lookup n-gram sizes must satisfy 1 <= min <= max",
        )
        _check(isinstance(self.suffix_depth, int) and 2 <= self.suffix_depth <= 256,
               f"suffix_depth must be an integer in [2, 256], got {self.suffix_depth!r}")
        _check(isinstance(self.suffix_cache_tokens, int) and self.suffix_cache_tokens >= 0,
               f"suffix_cache_tokens must be an integer >= 0, got {self.suffix_cache_tokens!r}")
        _check(self.suffix_max_factor > 0 and self.suffix_max_offset >= 0,
               "suffix_max_factor must be > 0 and suffix_max_offset >= 0")
        _check(0 <= self.suffix_min_prob <= 1, f"suffix_min_prob must be in [0, 1], got {self.suffix_min_prob!r}")


@dataclass(frozen=True)
class ModelRef:
    """Where a model comes from: a hub id (org/name[@rev]), a local directory, a .gguf file, or 'default'."""

    target: str = "default"
    draft: str | None = "default"
    weight_format: str = "fp32"
    max_context: int = 4096
    trust_remote_code: bool = False
    # The draft's precision cannot change the output (any q is verified exactly), only its speed.
    draft_weight_format: str | None = "int8"  # None: same as weight_format
    backend: str = "auto"  # one of BACKENDS; weight formats apply to torch only (GGUF weights run as stored)
    threads: int | None = None  # CPU threads for llama.cpp and torch; None: the CPUs this process may use
    # llama.cpp target (--exact): compute every row exactly as it would be computed alone, so greedy output
    # is bit-identical to plain decoding with the same kernels. False (the default, as in every anchor)
    # takes llama.cpp's fastest, batch-dependent kernels: lossless in distribution, but greedy output may
    # differ from plain decoding at near-ties, as llama.cpp's own speculative decoding does.
    batch_invariant: bool = False
    # torch backend: "auto" (CUDA when present, else CPU), "cpu", "cuda" or "cuda:N". On CUDA the weights
    # are bf16 unless fp32 is asked for, and forwards run on the static decoder with CUDA graphs.
    device: str = "auto"
    # Sequences that may decode at once (a server's slots), each with room for max_context tokens: llama.cpp
    # sizes its KV memory for them (exact mode: one KV stream per sequence). torch backends ignore it.
    parallel: int = 1

    def __post_init__(self) -> None:
        _check(bool(self.target), "a target model is required")
        _check(
            isinstance(self.parallel, int) and not isinstance(self.parallel, bool) and self.parallel >= 1,
            f"parallel must be an integer >= 1, got {self.parallel!r}",
        )
        _check(
            isinstance(self.device, str) and (self.device in ("auto", "cpu") or re.fullmatch(r"cuda(:\d+)?", self.device)),
            f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}",
        )
        _check(self.backend in BACKENDS, f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        _check(
            self.threads is None or (isinstance(self.threads, int) and self.threads >= 1),
            f"threads must be an integer >= 1, got {self.threads!r}",
        )
        _check(
            self.weight_format in WEIGHT_FORMATS,
            f"weight format must be one of {', '.join(WEIGHT_FORMATS)}; got {self.weight_format!r}",
        )
        _check(
            self.draft_weight_format is None or self.draft_weight_format in WEIGHT_FORMATS,
            f"draft weight format must be one of {', '.join(WEIGHT_FORMATS)}; got {self.draft_weight_format!r}",
        )
        _check(
            isinstance(self.max_context, int) and self.max_context >= 16,
            f"max_context must be an integer >= 16, got {self.max_context!r}",
        )


def to_json(obj: Any) -> str:
    """Serialise one of the config dataclasses to JSON."""
    return json.dumps({"type": type(obj).__name__, **dataclasses.asdict(obj)}, sort_keys=True)


_TYPES = {cls.__name__: cls for cls in (SamplingParams, SpecConfig, ModelRef)}


def from_json(text: str) -> Any:
    """Inverse of to_json; validates like the constructor does."""
    data = json.loads(text)
    cls = _TYPES.get(data.pop("type", None))
    _check(cls is not None, "unknown config type in JSON")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    _check(not unknown, f"unknown fields for {cls.__name__}: {sorted(unknown)}")
    if "stop" in data:
        data["stop"] = tuple(data["stop"])
    if "logit_bias" in data:
        data["logit_bias"] = tuple((int(token), float(bias)) for token, bias in data["logit_bias"])
    return cls(**data)


__all__ = [
    "COPYING_DRAFTERS", "adaptive_max_k",
    "BACKENDS", "ConfigError", "SamplingParams", "SpecConfig", "ModelRef", "WEIGHT_FORMATS", "to_json", "from_json",
]
