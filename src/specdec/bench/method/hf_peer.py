"""The peer: transformers' own generate (plain, assisted, prompt lookup) on the very same nn.Modules we decode with.

Assisted generation is instrumented without patching transformers: the target model instance gets a
wrapped `_get_candidate_generator` for the duration of one call, and the candidate generator it returns
reports every round (candidates proposed, matches accepted, time spent drafting) into a SpecStats, so its
acceptance figures are exact and computed the same way as ours.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.config import SamplingParams
from specdec.core.stats import SpecStats


@dataclass
class HFRun:
    tokens: list[int]
    seconds: float
    finish_reason: str
    stats: SpecStats
    settings: dict


def _clean_generation_config(**fields):
    """A GenerationConfig holding only what we set: nothing (repetition penalty, top-k...) leaks from the model's."""
    from transformers import GenerationConfig  # slow to import: here, not at CLI start

    return GenerationConfig(**{k: v for k, v in fields.items() if v is not None})


@contextlib.contextmanager
def _swapped_generation_config(model, config):
    """Let generate() merge our call config with a neutral model config, then put the model's back."""
    if model is None or config is None:
        yield
        return
    saved = model.generation_config
    model.generation_config = config
    try:
        yield
    finally:
        model.generation_config = saved


@contextlib.contextmanager
def _quiet_transformers():
    from transformers.utils import logging as hf_logging  # slow to import: here, not at CLI start

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


@contextlib.contextmanager
def _instrument_candidates(model, stats: SpecStats, settings: dict):
    """Record every assisted-decoding round of model.generate() into stats."""
    original = model._get_candidate_generator

    def wrapped(*args, **kwargs):
        generator = original(*args, **kwargs)
        settings["candidate_generator"] = type(generator).__name__
        for attr in ("num_assistant_tokens", "assistant_confidence_threshold", "num_output_tokens",
                     "max_matching_ngram_size"):
            if hasattr(generator, attr):
                value = getattr(generator, attr)
                settings[attr] = value if isinstance(value, (int, float, type(None))) else str(value)
        pending: list[int] = []
        get_candidates = generator.get_candidates
        update = generator.update_candidate_strategy

        def timed_get_candidates(input_ids, *a, **kw):
            began = time.perf_counter()
            candidate_ids, candidate_logits = get_candidates(input_ids, *a, **kw)
            stats.draft_seconds += time.perf_counter() - began
            pending.append(int(candidate_ids.shape[-1] - input_ids.shape[-1]))
            return candidate_ids, candidate_logits

        def counted_update(input_ids, scores, num_matches):
            proposed = pending.pop() if pending else 0
            stats.record_step(proposed, min(int(num_matches), proposed))
            return update(input_ids, scores, num_matches)

        generator.get_candidates = timed_get_candidates
        generator.update_candidate_strategy = counted_update
        return generator

    model._get_candidate_generator = wrapped
    try:
        yield
    finally:
        del model._get_candidate_generator


def hf_generate(
    target_model,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    eos_token_ids: Sequence[int],
    mode: str = "plain",
    draft_model=None,
    num_assistant_tokens: int | None = None,
    lookup_tokens: int | None = None,
    lookup_ngram: int | None = None,
    pad_token_id: int | None = None,
    cache_implementation: str | None = None,
) -> HFRun:
    """Run target_model.generate() once (mode: plain, assisted or prompt_lookup) and measure it.

    cache_implementation="static" is transformers' fast path on a GPU: a static cache, and generate()
    compiles the decoding forward with torch.compile (CUDA graphs) on its first call.

    EOS handling matches our engine: stop on the same EOS ids, or on none with params.ignore_eos (the
    EOS token is then generated like any other, not suppressed as min_new_tokens would do).
    """
    if mode not in ("plain", "assisted", "prompt_lookup"):
        raise ValueError(f"unknown transformers generate mode {mode!r}")
    if mode == "assisted" and draft_model is None:
        raise ValueError("assisted generation needs a draft model")
    if params.stop:
        raise ValueError("stop strings are not supported for the transformers peer in the benchmark")
    eos = [] if params.ignore_eos else sorted(int(t) for t in eos_token_ids)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    sampling = {}
    if not params.greedy:
        sampling = {
            "temperature": float(params.temperature), "top_k": int(params.top_k), "top_p": float(params.top_p),
            "min_p": float(params.min_p) if params.min_p > 0 else None,
        }
    call = _clean_generation_config(
        do_sample=not params.greedy, max_new_tokens=params.max_tokens, eos_token_id=eos, pad_token_id=pad,
        repetition_penalty=1.0, num_beams=1, use_cache=True, cache_implementation=cache_implementation,
        prompt_lookup_num_tokens=lookup_tokens if mode == "prompt_lookup" else None,
        max_matching_ngram_size=lookup_ngram if mode == "prompt_lookup" else None,
        **sampling,
    )
    neutral = _clean_generation_config(eos_token_id=eos, pad_token_id=pad)
    assistant_config = None
    if mode == "assisted" and num_assistant_tokens is not None:
        assistant_config = _clean_generation_config(
            eos_token_id=eos, pad_token_id=pad, num_assistant_tokens=int(num_assistant_tokens),
            num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0,
        )
    stats = SpecStats(num_prompt_tokens=len(prompt_ids))
    settings: dict = {"mode": mode, "cache_implementation": cache_implementation or "dynamic"}
    device = next(target_model.parameters()).device
    input_ids = torch.as_tensor([list(prompt_ids)], dtype=torch.long, device=device)
    kwargs = {"attention_mask": torch.ones_like(input_ids), "generation_config": call}
    if mode == "assisted":
        kwargs["assistant_model"] = draft_model
    if params.seed is not None:
        torch.manual_seed(params.seed)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_quiet_transformers())
        stack.enter_context(_swapped_generation_config(target_model, neutral))
        stack.enter_context(_swapped_generation_config(draft_model if mode == "assisted" else None, assistant_config))
        if mode != "plain":
            stack.enter_context(_instrument_candidates(target_model, stats, settings))
        began = time.perf_counter()
        with torch.inference_mode():
            output = target_model.generate(input_ids, **kwargs)
        seconds = time.perf_counter() - began
    sequences = output.sequences if hasattr(output, "sequences") else output
    tokens = [int(t) for t in sequences[0, len(prompt_ids):].tolist()]
    stats.num_generated_tokens = len(tokens)
    stats.total_seconds = seconds
    finish = "stop" if tokens and eos and tokens[-1] in set(eos) else "length"
    return HFRun(tokens, seconds, finish, stats, settings)


__all__ = ["HFRun", "hf_generate"]
