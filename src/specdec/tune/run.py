"""tune(): measure every candidate configuration on the user's prompts with the bench runner, then rank them.

Each draft model is measured in its own bench run on the one loaded target: plain decoding and every
(drafter x k policy) that uses it, interleaved per prompt with the order rotated and one warm-up each,
exactly as `specdec bench` measures (the same runner, summary formulas, c, verify cost and Leviathan
bound). So every speedup is over plain decoding measured in the same run, and each prompt-and-repeat turn
pairs a configuration's run with plain decoding's: the paired speedup and its confidence interval
(interval.py) are what the ranking reads. Model-free drafters (prompt lookup) join the first run. Draft models are loaded one at a time and released after their run; one that
cannot be loaded or whose vocabulary differs from the target's is listed with the reason, not measured.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdec.bench.datasets import BenchPrompt
from specdec.bench.method.methods import MethodOptions, expand_method
from specdec.bench.method.runner import BenchConfig, run_bench
from specdec.config import SamplingParams
from specdec.core.intervals import paired_ratios, speedup_interval
from specdec.decoder import SpecDecoder
from specdec.loading.models import ModelLoadError, VocabMismatchError, check_vocab_compatible
from specdec.tune.candidates import MIN_PAIRED_RUNS, MODEL_DRAFTERS, DraftCandidate, TuneOptions, methods_for
from specdec.tune.ranking import Recommendation, rank

# One bench run builds an engine, with its own KV cache, per configuration; a llama.cpp context holds 16
# sequences (backends/llamacpp_backend.MAX_SEQUENCES), so longer sweeps are split into runs of this many
# configurations, each with plain decoding measured again in the same run.
MAX_CONFIGURATIONS_PER_RUN = 12

# Figures copied from the bench summary row of each configuration (definitions in bench/method/render.py).
_ROW_FIELDS = (
    "speedup", "speedup_geomean", "tokens_per_second", "decode_tokens_per_second", "acceptance_rate",
    "mean_acceptance_length", "acceptance_rate_per_pos", "num_drafts_per_pos", "mean_k", "cost_ratio",
    "cost_ratio_source", "verify_cost", "leviathan_bound", "cost_model_bound", "expected_tokens_per_step",
    "identical_to_plain", "num_identical_to_plain", "generated_tokens", "num_drafts",
)


def default_repeats(num_prompts: int) -> int:
    """Repeats per prompt that give every configuration MIN_PAIRED_RUNS paired runs (1 from that many prompts)."""
    return max(1, -(-MIN_PAIRED_RUNS // max(num_prompts, 1)))


@dataclass
class TuneResult:
    """Ranked rows (one per draft x drafter x k policy), unusable drafts with reasons, the recommendation,
    and each measuring run's full bench results."""

    rows: list[dict]
    recommendation: Recommendation
    unusable: list[dict] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)  # {"label", "draft", "results"}
    info: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "info": self.info,
            "recommendation": self.recommendation.to_dict(),
            "rows": self.rows,
            "unusable": self.unusable,
            "runs": [{"label": r["label"], "draft": r["draft"], "summary": r["results"]["summary"]} for r in self.runs],
        }


def rows_from_results(results: dict, draft: DraftCandidate | None, confidence: float = 0.95) -> list[dict]:
    """One row per speculative method of a bench run: its configuration, its summary figures, and its paired
    speedup over plain decoding (geometric mean per interleaved turn) with a `confidence` interval."""
    summary = results["summary"]
    plain = summary["overall"].get("plain") or {}
    rows = []
    for method in results["config"]["methods"]:
        name = method["name"]
        if name == "plain" or name not in summary["overall"]:
            continue
        row = summary["overall"][name]
        spec = method["spec"]
        uses_model = spec["drafter"] in MODEL_DRAFTERS
        out = {
            "candidate": f"{draft.label} · {method['description']}" if uses_model and draft else method["description"],
            "method": name,
            "draft": draft.label if uses_model and draft else None,
            "draft_reference": draft.reference if uses_model and draft else None,
            "drafter": spec["drafter"],
            "k_policy": spec["k_policy"],
            "k": spec["num_speculative_tokens"],
            "spec": spec,
            "plain_tokens_per_second": plain.get("tokens_per_second"),
            **{key: row.get(key) for key in _ROW_FIELDS},
        }
        a = row.get("acceptance_rate")
        out["rejection_rate"] = None if a is None else round(1.0 - a, 4)
        ratios = paired_ratios(results["runs"], name)
        interval = speedup_interval(ratios, confidence)
        out["paired_runs"] = len(ratios)
        out["speedup_paired"] = round(interval.estimate, 4) if interval else (round(ratios[0], 4) if ratios else None)
        out["speedup_interval"] = interval.to_dict() if interval else None
        out["speedup_per_task"] = {
            task: (summary["per_task"][task].get(name) or {}).get("speedup") for task in summary["tasks"]
        }
        # What a perfect drafter would buy on this machine's measured pass costs, and the share of it reached
        # (bench/ceiling.py); absent when the run had no measured curve.
        ceiling = ((summary.get("ceiling") or {}).get("overall") or {}).get(name) or {}
        for key in ("ceiling", "ceiling_k", "decode_speedup", "share_of_ceiling", "rows_per_token"):
            out[key] = ceiling.get(key)
        rows.append(out)
    return rows


def _measure(target, draft_backend, methods, prompts, params, chat, repeats, warmup, extra, log) -> dict:
    plain = expand_method("plain", MethodOptions())[0]
    config = BenchConfig(methods=[plain, *methods], params=params, repeats=repeats, warmup=warmup, chat=chat,
                         extra=extra)
    return run_bench(SpecDecoder(target, draft_backend), list(prompts), config, log=log)


def tune(
    target,
    drafts: Sequence[DraftCandidate],
    prompts: Sequence[BenchPrompt],
    options: TuneOptions | None = None,
    params: SamplingParams | None = None,
    *,
    load_draft: Callable[[str], object] | None = None,
    chat: bool | None = None,
    repeats: int | None = None,
    warmup: bool = True,
    log: Callable[[str], None] | None = None,
) -> TuneResult:
    """Measure every (draft x drafter x k policy) against plain decoding on `prompts` and rank them.

    target: a loaded target backend. drafts: candidate draft models, loaded with load_draft(reference)
    unless they carry a backend. params: greedy by default (max 128 new tokens). repeats: timed runs per
    prompt and configuration, interleaved; None: enough for MIN_PAIRED_RUNS paired runs (default_repeats).
    """
    options = options or TuneOptions()
    repeats = default_repeats(len(prompts)) if repeats is None else repeats
    params = params or SamplingParams(max_tokens=128)
    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    model_drafters = [d for d in options.drafters if d in MODEL_DRAFTERS]
    model_free = [d for d in options.drafters if d not in MODEL_DRAFTERS]
    rows: list[dict] = []
    unusable: list[dict] = []
    runs: list[dict] = []
    notes: list[str] = []
    if model_drafters and not drafts:
        notes.append(f"no draft model given: {', '.join(model_drafters)} not measured")
    if drafts and not model_drafters:
        notes.append("only model-free drafters chosen: the draft models were not measured")

    def measure(label: str, candidate: DraftCandidate | None, backend, drafters: list[str]) -> None:
        methods = methods_for(drafters, options)
        parts = [methods[i:i + MAX_CONFIGURATIONS_PER_RUN] for i in range(0, len(methods), MAX_CONFIGURATIONS_PER_RUN)]
        for number, part in enumerate(parts, 1):
            name = label if len(parts) == 1 else f"{label} (part {number} of {len(parts)})"
            log(f"tune: measuring {name}: plain + {len(part)} configurations on {len(prompts)} prompts")
            results = _measure(target, backend, part, prompts, params, chat, repeats, warmup, {"tune_run": name}, log)
            gc.collect()  # the run's engines hold KV caches (llama.cpp sequences): free them before the next
            runs.append({"label": name, "draft": candidate.reference if candidate else None, "results": results})
            rows.extend(rows_from_results(results, candidate, options.confidence))

    pending_model_free = model_free
    for candidate in drafts if model_drafters else []:
        try:
            backend = candidate.backend
            if backend is None:
                if load_draft is None:
                    raise ModelLoadError("no backend given and no loader to load it")
                log(f"tune: loading draft {candidate.label}")
                backend = load_draft(candidate.reference or candidate.label)
            check_vocab_compatible(target, backend)
        except (ModelLoadError, VocabMismatchError) as exc:
            unusable.append({"draft": candidate.label, "reason": str(exc)})
            log(f"tune: cannot use draft {candidate.label}: {exc}")
            continue
        measure(candidate.label, candidate, backend, model_drafters + pending_model_free)
        pending_model_free = []
        del backend  # one draft model in memory at a time
    if pending_model_free:
        measure("model-free drafters", None, None, pending_model_free)
    ranked, recommendation = rank(rows, options.min_speedup)
    info = {
        "target": target.name,
        "num_prompts": len(prompts),
        "tasks": list(dict.fromkeys(p.task for p in prompts)),
        "sampling": dataclasses.asdict(params),
        "options": dataclasses.asdict(options),
        "repeats": repeats,
        "warmup": warmup,
        "notes": notes,
    }
    return TuneResult(ranked, recommendation, unusable, runs, info)


__all__ = ["MAX_CONFIGURATIONS_PER_RUN", "MIN_PAIRED_RUNS", "TuneResult", "default_repeats", "rows_from_results",
           "tune"]
