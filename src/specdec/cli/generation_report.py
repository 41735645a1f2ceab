"""One speculative run beside plain decoding on the same weights: measured speedup, cost ratio and Leviathan bound."""

from __future__ import annotations

import sys

from specdec.backends.kvcache import common_prefix_length
from specdec.config import SamplingParams, SpecConfig
from specdec.core.intervals import speedup_interval
from specdec.core.stats import leviathan_speedup
from specdec.kpolicy.calibration import forget_pass_costs, machine_ceiling

STALE_CURVE = 1.3  # a cached one-row pass cost this far from this run's own one-row steps is not trusted


def _warm_up(decoder, prompt_ids, params: SamplingParams, spec: SpecConfig) -> None:
    """One short run of each path so first-call allocation is not timed (gpt-fast does the same).

    A suffix of the real prompt and at most the real max_tokens: it fits wherever the request fits.
    """
    warm = SamplingParams(max_tokens=min(4, params.max_tokens), ignore_eos=True)
    decoder.generate(prompt_ids[-16:], warm, spec)
    decoder.generate(prompt_ids[-16:], warm, SpecConfig(drafter="none"))


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C during generation_report: the text generated before it, for the caller to print.

    A KeyboardInterrupt still, so a caller that does not look at the text stops as on any Ctrl-C.
    complete: the speculative run had finished (the interrupt came in the plain-decoding comparison).
    """

    def __init__(self, text: str, num_tokens: int, complete: bool):
        super().__init__()
        self.text, self.num_tokens, self.complete = text, num_tokens, complete

    @property
    def note(self) -> str:
        """What the interrupted command kept, for its one-line message."""
        if self.complete:
            return (f" during the plain-decoding comparison; the {self.num_tokens} generated tokens are printed, "
                    "without statistics")
        return f" after {self.num_tokens} generated tokens; the text so far is printed"


def generation_report(decoder, prompt_ids, params: SamplingParams, spec: SpecConfig, compare: bool = True,
                      stream: bool = False, repeats: int = 3, confidence: float = 0.95) -> dict:
    """Run speculative (and, when compare, plain) decoding; return text and every figure we print.

    With compare, speculative and plain decoding run `repeats` times each, interleaved in pairs whose order
    alternates (S P, P S, S P, ...), so drift and other load hit both alike; the speedup is the geometric
    mean of the paired ratios with a Student-t interval (intervals.py). The text and the statistics
    are the first speculative run's.
    """
    engine = decoder.engine(spec)
    engine.check_request(prompt_ids, params)  # refuse with the user's numbers, not the warm-up's
    _warm_up(decoder, prompt_ids, params, spec)
    tokens: list[int] = []
    text_parts: list[str] = []
    logprobs: list = []
    finish = "length"
    try:
        for chunk in engine.stream(prompt_ids, params):
            tokens += chunk.tokens
            logprobs += chunk.logprobs or []
            text_parts.append(chunk.text)
            finish = chunk.finish_reason or finish
            if stream:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    except KeyboardInterrupt as exc:
        raise GenerationInterrupted("".join(text_parts), len(tokens), complete=False) from exc
    finally:
        if stream:
            sys.stdout.write("\n")
    stats = engine.last_stats
    report = {
        "text": "".join(text_parts),
        "finish_reason": finish,
        "prompt_tokens": len(prompt_ids),
        "spec": {"drafter": spec.drafter, "k": spec.num_speculative_tokens, "k_policy": spec.k_policy},
        "stats": stats.to_dict(),
    }
    if params.logprobs is not None:  # the target's, from the verify pass (core/logprobs.py)
        def text(token: int) -> str:
            return decoder.tokenizer.decode([token]) if decoder.tokenizer is not None else str(token)

        report["logprobs"] = [{"token": lp.token, "text": text(lp.token), "logprob": round(lp.logprob, 6),
                               "top": [[t, text(t), round(p, 6)] for t, p in lp.top]} for lp in logprobs]
    # Drafting time per drafted token (the drafter's prompt prefill is not in it), as in Leviathan's c.
    draft_per_token = stats.draft_seconds / stats.num_draft_tokens if stats.num_draft_tokens else 0.0
    if compare:
        try:
            plain = decoder.plain_engine().generate(prompt_ids, params)
        except KeyboardInterrupt as exc:
            raise GenerationInterrupted(report["text"], len(tokens), complete=True) from exc
        target_per_forward = plain.stats.target_seconds / max(plain.stats.num_target_forwards, 1)
        cost_ratio = draft_per_token / target_per_forward if target_per_forward else 0.0
        # Same number of tokens on both sides, so tokens/s compares like with like.
        report["plain"] = plain.stats.to_dict()
        report["speedup"] = round(stats.tokens_per_second / plain.stats.tokens_per_second, 3) \
            if plain.stats.tokens_per_second else None
        if stats.num_draft_tokens and report["speedup"]:
            ratios = [report["speedup"]]
            try:
                ratios += _more_pairs(decoder, prompt_ids, params, spec, repeats - 1)
            except KeyboardInterrupt as exc:
                raise GenerationInterrupted(report["text"], len(tokens), complete=True) from exc
            interval = speedup_interval(ratios, confidence)
            report["speedup_runs"] = [round(r, 3) for r in ratios]
            if interval is not None:
                report["speedup_interval"] = interval.to_dict()
        report["cost_ratio"] = round(cost_ratio, 4)
        # Adaptive k and the confidence stop shorten drafts, so the bound uses the mean drafted length.
        mean_k = stats.num_draft_tokens / stats.num_drafts if stats.num_drafts else 0.0
        report["mean_draft_length"] = round(mean_k, 3)
        report["leviathan_bound"] = round(leviathan_speedup(stats.acceptance_rate, mean_k, cost_ratio), 3)
        # What a verification pass really costs here, in one-token passes (the bound above assumes 1).
        spec_steps = stats.num_target_forwards
        verify_cost = (stats.target_seconds / spec_steps) / target_per_forward if spec_steps and target_per_forward else 0.0
        report["verify_cost"] = round(verify_cost, 3)
        report["cost_model_bound"] = round(
            leviathan_speedup(stats.acceptance_rate, mean_k, cost_ratio, verify_cost), 3
        ) if verify_cost else None
        if params.greedy:
            report["identical_to_plain"] = plain.tokens == tokens
            if plain.tokens != tokens:
                report["divergence"] = first_divergence(decoder, prompt_ids, plain.tokens, tokens)
    report["runtime"] = _runtime(decoder)
    _add_ceiling(report, decoder.target, spec, target_per_forward if compare else None)
    return report


def _add_ceiling(report: dict, target, spec: SpecConfig, one_row_seconds: float | None) -> None:
    """report["ceiling"] from the target's measured pass-cost curve; report["ceiling_stale"] instead (and the
    cached curve dropped) when its one-row pass is over STALE_CURVE off this run's own one-row steps."""
    curve = target.pass_costs
    if not curve:
        return
    if one_row_seconds and not 1 / STALE_CURVE <= curve[min(curve)] / one_row_seconds <= STALE_CURVE:
        # A curve cached under other load (or another machine state) would print a false ceiling.
        report["ceiling_stale"] = {"curve_one_row_ms": round(curve[min(curve)] * 1000, 2),
                                   "measured_one_row_ms": round(one_row_seconds * 1000, 2)}
        forget_pass_costs(target)
        return
    c = report.get("cost_ratio", 0.0) if spec.drafter in ("draft_model", "hybrid") else 0.0
    ceiling, ceiling_k = machine_ceiling(curve, spec.num_speculative_tokens, c)
    report["ceiling"] = {"speedup": round(ceiling, 3), "k": ceiling_k, "draft_cost_ratio": round(c, 4),
                         "pass_ms": {size: round(cost * 1000, 2) for size, cost in sorted(curve.items())}}


def _more_pairs(decoder, prompt_ids, params: SamplingParams, spec: SpecConfig, count: int) -> list[float]:
    """`count` more paired runs (speculative tokens/s over plain's), the order alternating from plain-first."""
    ratios = []
    for index in range(count):
        runs = {}
        order = ("plain", "spec") if index % 2 == 0 else ("spec", "plain")
        for name in order:
            engine = decoder.plain_engine() if name == "plain" else decoder.engine(spec)
            if engine.drafter is not None:
                engine.drafter.forget()  # each run drafts as the first did: not from what earlier runs wrote
            runs[name] = engine.generate(prompt_ids, params).stats.tokens_per_second
        if runs["plain"] > 0 and runs["spec"] > 0:
            ratios.append(runs["spec"] / runs["plain"])
    return ratios


def _speedup_line(report: dict) -> str:
    interval = report.get("speedup_interval")
    if interval is None:
        return f"speedup              {report['speedup']:.2f}x  (one pair of runs: no estimate of its noise)"
    low, high = interval["low"], interval["high"]
    verdict = ("within noise of plain decoding" if low <= 1.0 <= high
               else "faster than plain decoding" if low > 1.0 else "slower than plain decoding")
    return (f"speedup              {interval['estimate']:.2f}x  [{low:.2f}, {high:.2f}] "
            f"({interval['confidence']:.0%} interval, {interval['pairs']} interleaved pairs of runs): {verdict}")


def _runtime(decoder) -> str | None:
    return decoder.target.runtime_summary()


def first_divergence(decoder, prompt_ids, plain_tokens: list[int], spec_tokens: list[int]) -> dict:
    """Where two greedy outputs part, and by how much the target's logits separate the two choices there.

    The logits are recomputed in one prefill of the prompt and the common prefix (a third kernel path),
    so the gap is the size of the near-tie, not the exact values either run saw.
    """
    index = common_prefix_length(plain_tokens, spec_tokens)
    plain_token = plain_tokens[index] if index < len(plain_tokens) else None
    spec_token = spec_tokens[index] if index < len(spec_tokens) else None
    result = {"token_index": index, "plain_token": plain_token, "speculative_token": spec_token, "logit_gap": None}
    if plain_token is None or spec_token is None:
        return result  # one output is a prefix of the other: they ended differently (EOS or a stop string)
    target = decoder.target
    cache = target.new_cache(target.max_context)
    try:
        logits = target.forward(list(prompt_ids) + list(plain_tokens[:index]), cache, num_logits=1)[0]
    finally:
        cache.trim(cache.length)
    result["logit_gap"] = round(float(logits[plain_token] - logits[spec_token]), 5)
    return result


def _divergence_line(report: dict) -> str:
    where = report.get("divergence") or {}
    gap = where.get("logit_gap")
    detail = f"; the target's logits for the two tokens differ by {abs(gap):.4f} there" if gap is not None else ""
    return (f"greedy identical     NO: from generated token {where.get('token_index')} (plain chose id "
            f"{where.get('plain_token')}, speculative {where.get('speculative_token')}{detail}). The fast kernels "
            "round a row in a batch differently from a row alone, which flips near-ties; --exact makes them identical")


def _ceiling_line(ceiling: dict) -> str:
    costs = "/".join(f"{ms:g}" for ms in ceiling["pass_ms"].values())
    rows = "/".join(str(size) for size in ceiling["pass_ms"])
    drafting = f", drafting at c = {ceiling['draft_cost_ratio']:.2f}" if ceiling["draft_cost_ratio"] else ""
    if ceiling["k"] == 0:
        what = "none: even a drafter whose every token is accepted cannot beat plain decoding here"
    else:
        what = f"{ceiling['speedup']:.2f}x at k={ceiling['k']} if every drafted token were accepted"
    return f"ceiling here         {what} (target passes of {rows} rows: {costs} ms{drafting})"


def format_generation_report(report: dict) -> str:
    stats = report["stats"]
    lines = [
        f"prompt tokens        {report['prompt_tokens']}",
        f"generated tokens     {stats['num_generated_tokens']}  (finish: {report['finish_reason']})",
    ]
    if report["spec"]["drafter"] == "none":
        # What a tuned config says where no drafter pays: no speculative run, so no speculative figures.
        lines += ["drafter              none: plain decoding, nothing drafted (give --drafter to speculate)",
                  f"plain decoding       {stats['tokens_per_second']:.2f} tokens/s"]
        if report.get("ceiling"):
            lines.append(_ceiling_line(report["ceiling"]))
        if report.get("runtime"):
            lines.append(f"runtime              {report['runtime']}")
        return "\n".join(lines)
    why = f"; {report['spec']['why']}" if report["spec"].get("why") else ""
    lines.append(
        f"drafter              {report['spec']['drafter']}, k={report['spec']['k']} ({report['spec']['k_policy']}){why}")
    drafted = stats.get("num_draft_tokens", 0) > 0
    if drafted:
        lines += [
            f"acceptance rate      {stats['acceptance_rate']:.3f}  (accepted / drafted tokens)",
            f"mean accept. length  {stats['mean_acceptance_length']:.2f}  (tokens per pass that verified a draft, "
            "incl. bonus)",
            f"tokens per pass      {stats['num_generated_tokens'] / max(stats.get('num_target_forwards', 0), 1):.2f}"
            "  (every decoding pass, plain steps included; the first token is the prefill's)",
            f"per-position accept  {', '.join(f'{x:.2f}' for x in stats['acceptance_rate_per_pos'])}",
        ]
    else:
        why = ("the adaptive policy found that drafting does not pay at the costs it measured here"
               if report["spec"]["k_policy"] == "adaptive" else "the drafter proposed nothing")
        lines.append(f"drafts               none: {why}; every step was a plain one")
    first = "  (first pair of runs)" if len(report.get("speedup_runs", ())) > 1 else ""
    lines.append(f"speculative          {stats['tokens_per_second']:.2f} tokens/s{first}")
    if "plain" in report:
        lines.append(f"plain decoding       {report['plain']['tokens_per_second']:.2f} tokens/s (same weights, same run)"
                     + first)
        if drafted:
            lines += [
                _speedup_line(report),
                f"cost ratio c         {report['cost_ratio']:.3f}  (drafting time per draft token / target forward)",
                f"Leviathan bound      {report['leviathan_bound']:.2f}x  (from measured acceptance and c)",
            ]
            if report.get("cost_model_bound") is not None:
                lines += [
                    f"verify cost          {report['verify_cost']:.2f}  (mean target pass / one-token pass; "
                    f"Leviathan assumes 1)",
                    f"bound at that cost   {report['cost_model_bound']:.2f}x",
                ]
        else:
            lines.append("speedup              none measured: with no drafts both runs decoded plainly, so their "
                         "difference is timing noise")
        if "identical_to_plain" in report:
            lines.append("greedy identical     yes  (vs plain decoding)" if report["identical_to_plain"]
                         else _divergence_line(report))
    if report.get("ceiling"):
        lines.append(_ceiling_line(report["ceiling"]))
    elif report.get("ceiling_stale"):
        stale = report["ceiling_stale"]
        lines.append(f"ceiling here         not shown: the cached pass-cost curve has a one-row pass at "
                     f"{stale['curve_one_row_ms']:g} ms, this run's one-row steps took {stale['measured_one_row_ms']:g} ms "
                     "(measured under other load?); the curve is measured again on the next run")
    if report.get("runtime"):
        lines.append(f"runtime              {report['runtime']}")
    return "\n".join(lines)
