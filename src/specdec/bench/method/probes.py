"""Timing probes the bench hangs on a model: forward hooks on an nn.Module or a backend's own records, summarised
per forward size; the backend's call counters and its measured pass-cost curve."""

from __future__ import annotations

import time


class ForwardProbe:
    """Times every forward of one nn.Module with hooks, recording (input tokens, seconds)."""

    def __init__(self, module):
        self.module = module
        self.records: list[tuple[int, float]] = []
        self._open: list[tuple[int, float]] = []
        self._handles = [
            module.register_forward_pre_hook(self._before, with_kwargs=True),
            module.register_forward_hook(self._after, with_kwargs=True),
        ]

    def _before(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        if ids is None and kwargs.get("inputs_embeds") is not None:
            n = int(kwargs["inputs_embeds"].shape[-2])
        else:
            n = int(ids.shape[-1]) if ids is not None else 0
        self._open.append((n, time.perf_counter()))

    def _after(self, module, args, kwargs, output):
        if self._open:
            n, began = self._open.pop()
            self.records.append((n, time.perf_counter() - began))

    def take(self) -> list[tuple[int, float]]:
        records, self.records = self.records, []
        return records

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class BackendProbe:
    """The same records as ForwardProbe, from a backend that logs its own forwards (llama.cpp has no nn.Module)."""

    def __init__(self, backend):
        self.backend = backend
        backend.forward_records = []

    def take(self) -> list[tuple[int, float]]:
        records, self.backend.forward_records = self.backend.forward_records, []
        return records

    def close(self) -> None:
        self.backend.forward_records = None


def make_probe(backend):
    """A forward probe for a backend: hooks on its nn.Module, else its own log; None if it has neither."""
    if backend is None:
        return None
    if backend.model is not None:
        return ForwardProbe(backend.model)
    if hasattr(backend, "forward_records"):
        return BackendProbe(backend)
    return None


def summarise_forwards(records: list[tuple[int, float]], short_max: int) -> dict:
    short = [s for n, s in records if n <= short_max]
    return {
        "calls": len(records),
        "seconds": round(sum(s for _, s in records), 6),
        "tokens": sum(n for n, _ in records),
        "short_calls": len(short),  # single-token forwards for the target, <= 2 tokens for the draft
        "short_seconds": round(sum(short), 6),
    }


def curve_ms(backend) -> dict[str, float] | None:
    """A backend's measured pass-cost curve in ms by row count (None when nothing calibrated it)."""
    curve = backend.pass_costs
    return {str(rows): round(seconds * 1000, 3) for rows, seconds in sorted(curve.items())} if curve else None


def fast_kernels(target) -> bool:
    """Whether the target runs llama.cpp's default fast kernels (batch-dependent: greedy output of our
    speculative methods may part from plain decoding at near-ties) rather than exact ones."""
    if target.model is not None:
        return False  # torch: one set of kernels
    return not target.batch_invariant


def call_counters(backend) -> tuple[int, float]:
    if backend is None:
        return 0, 0.0
    return int(backend.forward_calls), float(backend.forward_seconds)


def counters_delta(before: tuple[int, float], after: tuple[int, float]) -> dict:
    return {"calls": after[0] - before[0], "seconds": round(after[1] - before[1], 6)}
