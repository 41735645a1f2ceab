"""Run every method on every prompt, interleaved, on one loaded model pair; collect raw per-run measurements.

Methods run interleaved per prompt (prompt 1: all methods, prompt 2: all methods, ...) with the order
rotated from prompt to prompt, so thermal drift, other load on the machine and cache effects hit every
method alike. Each method first gets one short warm-up run that is not timed.

Forward time is measured on the nn.Modules themselves (forward pre/post hooks on the target and the
draft model), so ours and transformers' generate are timed the same way: the target's single-token
forwards give the cost of one plain step, the draft's 1-2 token forwards the cost of one draft step, and
their ratio is the cost ratio c of the Leviathan model. The backends' own counters are recorded as well.

The exact_ methods run on a second llama.cpp target with the exact kernels (bench/method/exact.py), loaded when
the runner is made and freed by close(); each of them is compared with exact_plain, the others with plain.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from specdec.backends.kvcache import common_prefix_length, release_retained
from specdec.bench.datasets import BenchPrompt
from specdec.bench.llamacpp_peer import PeerConfig, PeerPool, binaries_dir, gguf_files, missing_reason
from specdec.bench.method.aggregate import summarise
from specdec.bench.method.environment import environment, torch_threads
from specdec.bench.method.exact import close_exact_decoder, load_exact_decoder
from specdec.bench.method.hf_peer import hf_generate
from specdec.bench.method.methods import BASELINES, EXACT_BASELINE, EXACT_PREFIX, Method
from specdec.bench.method.probes import (
    call_counters,
    counters_delta,
    curve_ms,
    fast_kernels,
    make_probe,
    summarise_forwards,
)
from specdec.bench.method.records import raw_stats
from specdec.config import SamplingParams
from specdec.core.stats import SpecStats

# Draft forwards of at most this many tokens are decode steps (the catch-up of 1-2 tokens, then 1 each);
# longer ones are the draft's prompt prefill and are left out of the cost ratio.
DRAFT_DECODE_MAX_TOKENS = 2


WARMUP_PROMPT_TOKENS = 48


@dataclass
class BenchConfig:
    """What to run: methods, sampling (greedy by default), repeats, warm-up and prompt form."""

    methods: list[Method]
    params: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=128))
    repeats: int = 1
    warmup: bool = True
    chat: bool | None = None  # None: the tokenizer's chat template when it has one
    rotate: bool = True
    extra: dict = field(default_factory=dict)  # recorded in results["config"] (model names, CLI flags...)
    llamacpp_bin: str | None = None  # folder of llama-server for the llamacpp_* peers (None: the default place)
    # (target, draft) GGUF files for the llamacpp_* peers; None: llamacpp_peer.gguf_files(decoder)
    llamacpp_gguf: tuple | None = None
    threads: int | None = None  # the llamacpp_* peers' threads; None: those of our target


@dataclass
class _Outcome:
    tokens: list[int]
    seconds: float
    finish_reason: str
    stats: SpecStats
    settings: dict = field(default_factory=dict)


class BenchRunner:
    """Holds a SpecDecoder and runs methods on token-id prompts, measuring each call."""

    def __init__(self, decoder, config: BenchConfig, log: Callable[[str], None] | None = None):
        self.decoder = decoder
        self.config = config
        self.log = log or (lambda message: print(message, file=sys.stderr, flush=True))
        target_model = decoder.target.model
        draft_model = decoder.draft.model if decoder.draft is not None else None
        self.target_model, self.draft_model = target_model, draft_model
        self.target_probe = make_probe(decoder.target)
        self.draft_probe = make_probe(decoder.draft)
        tokenizer = decoder.tokenizer
        self.pad_token_id = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        # Our fast-mode methods may part from plain at near-ties only on llama.cpp's default fast kernels.
        self.fast_kernels = fast_kernels(decoder.target)
        self.exact = None  # the exact_ methods' SpecDecoder (a second target, exact kernels; shared draft)
        self.exact_probe = None
        self.peers = None
        try:
            if any(m.exact for m in config.methods):
                began = time.perf_counter()
                self.exact = load_exact_decoder(decoder)
                self.exact_probe = make_probe(self.exact.target)
                self.log(f"loaded the exact-kernel target for the exact_ methods in "
                         f"{time.perf_counter() - began:.1f}s ({self.exact.target.runtime_summary()})")
            if any(m.kind == "llamacpp" for m in config.methods):
                self.peers = llamacpp_peers(decoder, config.llamacpp_bin, config.llamacpp_gguf, config.threads)
        except BaseException:
            self.close()  # the probes and the exact target
            raise

    def close(self) -> None:
        for probe in (self.target_probe, self.draft_probe, self.exact_probe):
            if probe is not None:
                probe.close()
        self.exact_probe = None
        if self.exact is not None:
            close_exact_decoder(self.exact)
            self.exact = None
        if self.peers is not None:
            self.peers.close()

    def decoder_for(self, method: Method):
        """The SpecDecoder a method of ours runs on: the exact-kernel one for exact_ methods."""
        return self.exact if method.exact else self.decoder

    # -- one call -----------------------------------------------------------------------------------------

    def run_method(self, method: Method, prompt_ids: Sequence[int], params: SamplingParams) -> _Outcome:
        if method.kind == "specdec":
            decoder = self.decoder_for(method)
            engine = decoder.engine(method.spec)
            # Every method prefills cold, as the peers do (cache_prompt off): an engine keeps its last request's
            # tokens for a next one that shares them, and with methods interleaved whichever ran last would
            # otherwise get a second turn's conversation prefilled already.
            for backend in (decoder.target, decoder.draft):
                if backend is not None:
                    release_retained(backend)
            began = time.perf_counter()
            generation = engine.generate(prompt_ids, params)
            seconds = time.perf_counter() - began
            return _Outcome(generation.tokens, seconds, generation.finish_reason, generation.stats)
        if method.kind == "llamacpp":
            run = self.peers.run(PeerConfig(method.llamacpp_mode, method.llamacpp_draft_max), prompt_ids, params)
            return _Outcome(run.tokens, run.seconds, run.finish_reason, run.stats, run.settings)

        run = hf_generate(
            self.target_model, prompt_ids, params, self.decoder.target.eos_token_ids, mode=method.hf_mode,
            draft_model=self.draft_model, num_assistant_tokens=method.hf_num_assistant_tokens,
            lookup_tokens=method.hf_lookup_tokens, lookup_ngram=method.hf_lookup_ngram,
            pad_token_id=self.pad_token_id,
        )
        return _Outcome(run.tokens, run.seconds, run.finish_reason, run.stats, run.settings)

    def measure(self, method: Method, prompt_ids: Sequence[int], params: SamplingParams) -> tuple[dict, list[int]]:
        """Run once with the forward probes and backend counters reset around the call; return a run record."""
        for probe in (self.target_probe, self.draft_probe, self.exact_probe):
            if probe is not None:
                probe.take()
        target_probe = self.exact_probe if method.exact else self.target_probe
        target, draft = self.decoder_for(method).target, self.decoder.draft
        counters0 = call_counters(target), call_counters(draft)
        outcome = self.run_method(method, prompt_ids, params)
        counters1 = call_counters(target), call_counters(draft)
        target_fwd = summarise_forwards(target_probe.take() if target_probe else [], 1)
        draft_fwd = summarise_forwards(
            self.draft_probe.take() if self.draft_probe else [], DRAFT_DECODE_MAX_TOKENS
        )
        stats = outcome.stats
        if method.kind == "hf":
            stats.target_seconds = target_fwd["seconds"]
            if method.hf_mode == "plain":
                stats.num_target_forwards = max(target_fwd["calls"] - 1, 0)  # the first one is the prefill
        record = {
            "method": method.name,
            "prompt_tokens": len(prompt_ids),
            "prefill_tokens": _prefill_tokens(method, prompt_ids, outcome),
            "generated_tokens": len(outcome.tokens),
            "seconds": round(outcome.seconds, 6),
            "tokens_per_second": round(len(outcome.tokens) / outcome.seconds, 4) if outcome.seconds > 0 else 0.0,
            "finish_reason": outcome.finish_reason,
            "stats": raw_stats(stats),
            "target_forwards": target_fwd,
            "draft_forwards": draft_fwd,
            "backend_counters": {
                "target": counters_delta(counters0[0], counters1[0]),
                "draft": counters_delta(counters0[1], counters1[1]),
            },
        }
        if outcome.settings:
            record[f"{method.kind}_settings"] = outcome.settings
        return record, list(outcome.tokens)

    # -- the whole benchmark ------------------------------------------------------------------------------

    def encode(self, prompt: BenchPrompt, history: Sequence[tuple[BenchPrompt, str]] = ()) -> list[int]:
        """The prompt's ids; history: the conversation before it, (earlier turn, the answer it got) in order."""
        chat = not (self.config.chat is False or (self.config.chat is None and not _has_chat_template(self.decoder)))
        if not history:
            return self.decoder.encode(prompt.text, chat=True) if chat else \
                self.decoder.encode(prompt.completion_text, chat=False)
        if chat:
            messages = [message for turn, answer in history for message in
                        ({"role": "user", "content": turn.text}, {"role": "assistant", "content": answer})]
            return self.decoder.encode_chat(messages + [{"role": "user", "content": prompt.text}])
        text = "\n\n".join(f"{turn.completion_text}\n{answer}" for turn, answer in history)
        return self.decoder.encode(f"{text}\n\n{prompt.completion_text}", chat=False)

    def _later_turn_ids(self, prompt: BenchPrompt, by_key: dict, outputs: dict, limit: int,
                        skipped: list) -> list[int] | None:
        """A later turn's ids: its earlier turns with plain decoding's answers, then it; None (and a skipped
        record) when an earlier turn did not run or the conversation does not fit the context."""
        history = []
        for earlier_id in prompt.earlier_ids:
            key = f"{prompt.task}/{earlier_id}"
            if key not in outputs or key not in by_key:
                skipped.append({"task": prompt.task, "id": prompt.id, "prompt_tokens": None,
                                "reason": f"its earlier turn {earlier_id} was not run"})
                return None
            history.append((by_key[key], outputs[key]["plain_text"]))
        ids = self.encode(prompt, history)
        if len(ids) + self.config.params.max_tokens > limit:
            skipped.append({"task": prompt.task, "id": prompt.id, "prompt_tokens": len(ids),
                            "reason": f"the conversation + max_tokens exceeds the context of {limit}"})
            return None
        return ids

    def _describe_mismatches(self, batch: list[dict], tokens: dict[str, list[int]]) -> None:
        """For a greedy mismatch keep both token lists and the first differing tokens as text, to debug it."""
        for record in batch:
            for baseline in BASELINES:
                index = record.get(f"first_mismatch_to_{baseline}")
                if index is None:
                    continue
                mine, theirs = tokens[record["method"]], tokens[baseline]
                record.setdefault("tokens", mine)
                record[f"mismatch_to_{baseline}"] = {
                    "index": index,
                    "method_token": mine[index] if index < len(mine) else None,
                    "baseline_token": theirs[index] if index < len(theirs) else None,
                    "method_text": _decode(self.decoder, mine[index:index + 1]),
                    "baseline_text": _decode(self.decoder, theirs[index:index + 1]),
                    "common_prefix_text": _decode(self.decoder, mine[max(0, index - 8):index]),
                    "baseline_tokens": theirs,
                }

    def warm_up(self, prompt_ids: Sequence[int]) -> None:
        """One short untimed run of each method (allocates caches, loads kernels, builds HF objects).

        It uses the tail of the first prompt: a full-length prefill per method would cost minutes on a CPU.
        """
        params = replace(self.config.params, max_tokens=min(8, self.config.params.max_tokens), ignore_eos=True)
        prompt_ids = list(prompt_ids)[-WARMUP_PROMPT_TOKENS:]
        for method in self.config.methods:
            began = time.perf_counter()
            self.run_method(method, prompt_ids, params)
            self.log(f"  warm-up {method.name:<18} {time.perf_counter() - began:6.2f}s")

    def run(self, prompts: Sequence[BenchPrompt]) -> dict:
        config = self.config
        params = config.params
        methods = config.methods
        limit = self.decoder.target.max_context
        if any(p.earlier_ids for p in prompts) and "plain" not in [m.name for m in methods]:
            raise ValueError("later turns are built from plain decoding's answers to the earlier ones: add the "
                             "plain method, or run first turns only")
        # A later turn is encoded when its turn comes, from the answers its earlier turns got (None until then).
        encoded: list[tuple[BenchPrompt, list[int] | None]] = []
        skipped_prompts = []
        for prompt in prompts:
            ids = None if prompt.earlier_ids else self.encode(prompt)
            if ids is not None and len(ids) + params.max_tokens > limit:
                skipped_prompts.append({"task": prompt.task, "id": prompt.id, "prompt_tokens": len(ids),
                                        "reason": f"prompt + max_tokens exceeds the context of {limit}"})
                continue
            encoded.append((prompt, ids))
        if not any(ids is not None for _, ids in encoded):
            raise ValueError("no benchmark prompt fits the model context; raise --max-context or lower --max-tokens")
        by_key = {f"{p.task}/{p.id}": p for p, _ in encoded}
        started = time.time()
        if config.warmup:
            self.log(f"warming up {len(methods)} methods")
            self.warm_up(next(ids for _, ids in encoded if ids is not None))
        runs: list[dict] = []
        outputs: dict[str, dict] = {}
        total = len(encoded) * config.repeats
        for index, (prompt, ids) in enumerate(encoded):
            if ids is None:
                ids = self._later_turn_ids(prompt, by_key, outputs, limit, skipped_prompts)
                if ids is None:
                    continue
            for repeat in range(config.repeats):
                turn = index * config.repeats + repeat
                shift = turn % len(methods) if config.rotate else 0
                order = methods[shift:] + methods[:shift]
                tokens_by_method: dict[str, list[int]] = {}
                batch: list[dict] = []
                for method in order:
                    record, tokens = self.measure(method, ids, params)
                    record.update(task=prompt.task, prompt_id=prompt.id, repeat=repeat)
                    tokens_by_method[method.name] = tokens
                    batch.append(record)
                _mark_identical(batch, tokens_by_method, params.greedy)
                self._describe_mismatches(batch, tokens_by_method)
                runs += sorted(batch, key=lambda r: [m.name for m in methods].index(r["method"]))
                if repeat == 0 and "plain" in tokens_by_method:
                    outputs[f"{prompt.task}/{prompt.id}"] = {
                        "prompt_tokens": len(ids),
                        "prompt_ids": list(ids),  # with plain_tokens: the copy bound (bench/ceiling.py)
                        "plain_text": _decode(self.decoder, tokens_by_method["plain"]),
                        "plain_tokens": tokens_by_method["plain"],
                    }
                self.log(_progress_line(turn + 1, total, prompt, batch, self.fast_kernels))
        env = environment(self.decoder, config.extra.get("weight_format"))
        if self.exact is not None:
            env["exact_target"] = self.exact.target.describe()
        return {
            "config": {
                "methods": [m.to_dict() for m in methods],
                "sampling": {
                    "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
                    "min_p": params.min_p, "max_tokens": params.max_tokens, "seed": params.seed,
                    "ignore_eos": params.ignore_eos, "greedy": params.greedy,
                },
                "repeats": config.repeats,
                "warmup": config.warmup,
                "chat": config.chat if config.chat is not None else _has_chat_template(self.decoder),
                "interleaved": True,
                "rotated_order": config.rotate,
                "tasks": list(dict.fromkeys(p.task for p, _ in encoded)),
                "num_prompts": len(encoded),
                **config.extra,
            },
            "environment": env,
            # The per-row-count pass costs the adaptive policies read in this run (calibration.py), in ms: the
            # report prints them and the ceiling a perfect drafter would reach on them.
            "pass_costs_ms": {
                mode: curve for mode, decoder in (("default", self.decoder), ("exact", self.exact))
                if decoder is not None and (curve := curve_ms(decoder.target))
            },
            "skipped_prompts": skipped_prompts,
            "runs": runs,
            "outputs": outputs,
            "wall_seconds": round(time.time() - started, 3),
        }


def _mark_identical(batch: list[dict], tokens: dict[str, list[int]], greedy: bool) -> None:
    """Greedy decoding is lossless only if every method reproduces the baseline token for token.

    Every method is held to `plain`, and a peer's or the exact mode's methods to their own plain decoding
    too, except that the exact_ methods are held to `exact_plain` only (plain runs other kernels).
    """
    for record in batch:
        name = record["method"]
        for baseline in BASELINES:
            key = f"identical_to_{baseline}"
            peer = baseline != "plain" and not name.startswith(baseline.removesuffix("plain"))
            other_kernels = baseline == "plain" and name.startswith(EXACT_PREFIX)
            if name == baseline or baseline not in tokens or peer or other_kernels:
                continue
            if not greedy:
                record[key] = None  # sampled outputs differ by design; losslessness is a distribution test
                continue
            mine, theirs = tokens[name], tokens[baseline]
            record[key] = mine == theirs
            if mine != theirs:
                record[key.replace("identical", "first_mismatch")] = common_prefix_length(mine, theirs)


def _prefill_tokens(method: Method, prompt_ids: Sequence[int], outcome: _Outcome) -> int | None:
    """The prompt tokens that went through the timed prefill (None when the method times no prefill).

    Our engine prefills the prompt (its last row's logits give the first token), less any prefix its cache kept
    from the previous request; llama-server says how many it evaluated
    (timings.prompt_n); transformers' generate has no separate prefill time.
    """
    if outcome.stats.prefill_seconds <= 0:
        return None
    if method.kind == "llamacpp":
        evaluated = (outcome.settings.get("timings") or {}).get("prompt_n")
        return int(evaluated) if isinstance(evaluated, (int, float)) else len(prompt_ids)
    cached = int(getattr(outcome.stats, "num_cached_prompt_tokens", 0) or 0)
    return max(len(prompt_ids) - cached, 0)


def _progress_line(done: int, total: int, prompt: BenchPrompt, batch: list[dict], fast: bool = False) -> str:
    """Rates of one prompt; a greedy difference is flagged, as a near-tie flip where the fast kernels allow one."""
    rates = "  ".join(f"{r['method']}={r['tokens_per_second']:.1f}" for r in batch)
    exact = [r["method"] for r in batch if r.get(f"identical_to_{EXACT_BASELINE}") is False]
    differs = [r["method"] for r in batch if r.get("identical_to_plain") is False]
    flips = [n for n in differs if fast and not n.startswith(("hf_", "llamacpp_"))]
    bad = exact + [n for n in differs if n not in flips]
    flag = f"  NOT IDENTICAL: {', '.join(bad)}" if bad else ""
    flag += f"  differs from plain (fast-kernel near-tie): {', '.join(flips)}" if flips else ""
    return f"[{done}/{total}] {prompt.task}/{prompt.id}  tok/s: {rates}{flag}"


def _has_chat_template(decoder) -> bool:
    return bool(getattr(decoder.tokenizer, "chat_template", None))


def _decode(decoder, tokens: list[int]) -> str:
    tokenizer = decoder.tokenizer
    if tokenizer is None:
        return " ".join(map(str, tokens))
    return tokenizer.decode(tokens, skip_special_tokens=True)


def llamacpp_peers(decoder, bin_dir: str | None, ggufs: tuple | None = None, threads: int | None = None):
    """The llama-server pool for this pair's GGUF files, on `threads` (default: our target's) and its
    context."""
    folder = binaries_dir(bin_dir)
    target_gguf, draft_gguf = ggufs or gguf_files(decoder)
    reason = missing_reason(folder, target_gguf)
    if reason:
        raise ValueError(f"llama.cpp peers cannot run: {reason}")
    threads = threads or decoder.target.threads or torch_threads()
    return PeerPool(folder, target_gguf, draft_gguf, threads, decoder.target.max_context)


def run_bench(decoder, prompts: Sequence[BenchPrompt], config: BenchConfig, log=None) -> dict:
    """Run the benchmark and return results with their summary (see report.summarise)."""
    runner = BenchRunner(decoder, config, log)
    try:
        results = runner.run(prompts)
    finally:
        runner.close()
    results["summary"] = summarise(results)
    return results
