"""The /infill answer as llama-server writes it: the response object (content, timings, tokens_cached, truncated,
stop_type), its stream events, `response_fields`, and llama-server's two infill stops (n_indent, t_max_predict_ms)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import Request

from specdec.fim import InfillPrompt
from specdec.server import sse
from specdec.server.dispatch import engine_error, watch_disconnect
from specdec.server.worker import Job


def indent_cut(text: str, n_indent: int) -> int | None:
    """Where llama-server's n_indent rule ends a completion: at the first line after the first newline whose
    text starts with less than n_indent spaces or tabs (the text is cut after that whitespace); None: not yet."""
    if n_indent <= 0:
        return None
    start = text.find("\n")
    while start != -1:
        line_start = pos = start + 1
        while pos < len(text) and text[pos] in " \t":
            pos += 1
        if pos < len(text) and text[pos] != "\n" and pos - line_start < n_indent:
            return pos
        start = text.find("\n", line_start)
    return None


def time_limit_cut(text: str, new_from: int, elapsed_ms: float, limit_ms: int) -> int | None:
    """llama-server's t_max_predict_ms: once generating has taken longer, the completion ends after the next
    newline it writes (here: the first one in the text new since `new_from`); None: go on."""
    if limit_ms <= 0 or elapsed_ms <= limit_ms:
        return None
    newline = text.find("\n", new_from)
    return None if newline == -1 else newline + 1


class InfillStops:
    """Applies both stops to a completion's text as it arrives; `stopped` once either has ended it."""

    def __init__(self, n_indent: int, t_max_predict_ms: int, clock=time.perf_counter):
        self.n_indent, self.limit_ms, self.clock = n_indent, t_max_predict_ms, clock
        self.text = ""
        self.began: float | None = None
        self.stopped = False

    def feed(self, new: str) -> str:
        """The part of `new` the completion keeps (all of it until a stop; nothing after one)."""
        if self.stopped or not new:
            return ""
        now = self.clock()
        self.began = now if self.began is None else self.began
        combined = self.text + new
        cuts = [cut for cut in (indent_cut(combined, self.n_indent),
                                time_limit_cut(combined, len(self.text), (now - self.began) * 1000, self.limit_ms))
                if cut is not None]
        end = min(cuts) if cuts else len(combined)
        self.stopped = bool(cuts)
        kept = combined[len(self.text):end]
        self.text = combined[:end]
        return kept


def select_fields(body: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """llama-server's response_fields: a flat object keyed by each path ("timings/prompt_n") found in the body;
    paths not found are left out."""
    out: dict[str, Any] = {}
    for path in paths:
        current: Any = body
        for key in path.split("/"):
            if not (isinstance(current, dict) and key in current):
                break
            current = current[key]
        else:
            out[path] = current
    return out


class InfillReply:
    """One /infill request's answers: collected (one per completion) or streamed."""

    def __init__(self, state: Any, model: str, built: InfillPrompt, settings: dict, req: Any,
                 wanted: int):
        self.state, self.model, self.built, self.settings, self.req = state, model, built, settings, req
        self.cache_only = wanted == 0  # n_predict 0: the prompt is prefilled (and kept for reuse), no text
        self.prompt_text = state.engine.decode(built.ids)  # once, for every completion of the request

    async def collect(self, job: Job, request: Request, index: int) -> dict[str, Any]:
        stops = InfillStops(self.req.n_indent, self.req.t_max_predict_ms)
        tokens: list[int] = []
        last = None
        watcher = asyncio.create_task(watch_disconnect(request, job))
        try:
            async for output in job.outputs_until_done():
                if output.error is not None:
                    raise engine_error(output.error)
                last = output
                if not self.cache_only:
                    stops.feed(output.text)
                    tokens += output.tokens
                if stops.stopped:
                    break
        finally:
            watcher.cancel()
            job.cancel()
        return self.body(job, stops.text, tokens, last, stops.stopped, index)

    async def stream(self, job: Job):
        stops = InfillStops(self.req.n_indent, self.req.t_max_predict_ms)
        tokens: list[int] = []
        last = None
        async for output in job.outputs_until_done():
            if output.error is not None:
                error = engine_error(output.error)
                self.state.metrics.request_error(error.status)
                yield sse.event(error.body())
                return
            last = output
            if self.cache_only:
                continue
            kept = stops.feed(output.text)
            tokens += output.tokens
            if kept or output.tokens:
                yield sse.event({"index": 0, "content": kept, "tokens": list(output.tokens), "stop": False,
                                 "id_slot": -1, "tokens_predicted": len(tokens),
                                 "tokens_evaluated": len(self.built.ids)})
            if stops.stopped or output.finish_reason is not None:
                break
        job.cancel()
        body = self.body(job, stops.text, tokens, last, stops.stopped, 0)
        body["content"], body["tokens"] = "", []  # llama-server: the text went in the events before
        yield sse.event(body)

    def body(self, job: Job, text: str, tokens: list[int], last, cut: bool, index: int) -> dict[str, Any]:
        """llama-server's final object for one completion, with specdec's statistics beside."""
        stats = last.stats if last is not None and last.stats is not None else job.stats
        cached = stats.num_cached_prompt_tokens if stats is not None else 0
        prompt_n = len(self.built.ids) - cached
        predicted = 0 if self.cache_only else len(tokens)
        stop_type, word = self._stop(job, last, text, tokens, cut)
        body = {
            "index": index, "content": text, "tokens": tokens if self.req.return_tokens else [], "id_slot": -1,
            "stop": True, "model": self.model, "tokens_predicted": predicted,
            "tokens_evaluated": len(self.built.ids), "generation_settings": self.settings,
            "prompt": self.prompt_text, "has_new_line": "\n" in text,
            "truncated": self.built.truncated, "stop_type": stop_type, "stopping_word": word,
            "tokens_cached": len(self.built.ids) + predicted,
            "timings": self._timings(job, cached, prompt_n, predicted, stats),
            "specdec": self.state.specdec_stats(job),
        }
        return select_fields(body, self.req.response_fields) if self.req.response_fields else body

    def _stop(self, job: Job, last, text: str, tokens: list[int], cut: bool) -> tuple[str, str]:
        reason = last.finish_reason if last is not None else job.finish_reason
        if cut or reason == "length" or self.cache_only:
            return "limit", ""
        if reason == "stop":
            eos = self.state.engine.target.eos_token_ids
            if tokens and tokens[-1] in eos and not job.params.ignore_eos:
                return "eos", ""
            rest = self.state.engine.decode(tokens)[len(text):]
            return "word", next((s for s in job.params.stop if rest.startswith(s)), "")
        return "none", ""

    @staticmethod
    def _timings(job: Job, cached: int, prompt_n: int, predicted: int, stats) -> dict[str, Any]:
        now = time.perf_counter()
        started = job.started_at or job.arrived_at
        first = job.first_token_at or now
        prompt_ms = max(first - started, 0.0) * 1000
        predicted_ms = max((job.finished_at or now) - first, 0.0) * 1000

        def rate(n: int, ms: float) -> tuple[float | None, float | None]:
            return (ms / n if n else None), (1000 * n / ms if ms > 0 else None)

        out = {"cache_n": cached, "prompt_n": prompt_n, "prompt_ms": round(prompt_ms, 3),
               "predicted_n": predicted, "predicted_ms": round(predicted_ms, 3)}
        out["prompt_per_token_ms"], out["prompt_per_second"] = rate(prompt_n, prompt_ms)
        out["predicted_per_token_ms"], out["predicted_per_second"] = rate(predicted, predicted_ms)
        if stats is not None and stats.num_draft_tokens:
            out["draft_n"], out["draft_n_accepted"] = stats.num_draft_tokens, stats.num_accepted_tokens
        return out
