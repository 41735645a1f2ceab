"""The GPU bench (`specdec bench --device cuda`): pass-cost curves, our decoding methods and transformers' generate on the same modules, in one run, each rate beside the bandwidth limit.

Methods (all greedy, interleaved per prompt with the order rotated, each warmed up once untimed):
  plain             our engine, no drafter (static KV cache + CUDA graphs on a GPU)
  replay_k8         a drafter that replays plain decoding's output, k = 8: what a perfect drafter buys here
  lookup_adaptive   prompt lookup, adaptive k up to --k-max (the measured cost curve says rows are nearly free)
  draft_k4          the draft model, k = 4
  draft_adaptive    the draft model, adaptive k up to --k-max
  hf_eager          transformers generate(), dynamic cache (eager)
  hf_static         transformers generate(cache_implementation="static"): its torch.compile path
  hf_assisted_k4    transformers assisted generation, same draft, 4 tokens a round, no confidence stop
  hf_prompt_lookup  transformers prompt lookup decoding (10 tokens, 2-grams: its defaults)
Every timed call is bracketed by device synchronisations.
"""

from __future__ import annotations

import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from specdec.bench.gpu.dummy import weight_bytes
from specdec.bench.method.hf_peer import hf_generate
from specdec.config import SamplingParams, SpecConfig
from specdec.drafters import create_drafter
from specdec.drafters.base import Draft, Drafter
from specdec.engine.single import SpeculativeEngine
from specdec.kpolicy.calibration import fitting_context, measure_pass_costs

GPU_METHODS = ("plain", "replay_k8", "lookup_adaptive", "draft_k4", "draft_adaptive", "hf_eager", "hf_static",
               "hf_assisted_k4", "hf_prompt_lookup")
DEFAULT_GPU_METHODS = tuple(m for m in GPU_METHODS if m != "hf_static")  # hf_static compiles for minutes
NEEDS_DRAFT = ("draft_k4", "draft_adaptive", "hf_assisted_k4")
CURVE_SIZES = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64)
WARMUP_TOKENS = 16


class ReplayDrafter(Drafter):
    """Proposes the next k tokens of a recorded output for the same prompt (the ceiling of any drafter)."""

    name = "replay"

    def __init__(self, references: dict[tuple[int, ...], list[int]]):
        self.references = references
        self.reference: list[int] = []
        self.prompt_length = 0

    def begin(self, prompt, params, generator) -> None:
        self.reference = self.references.get(tuple(prompt), [])
        self.prompt_length = len(prompt)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        done = len(context) - self.prompt_length
        return Draft(list(self.reference[done : done + k]))

    def accepted(self, num_accepted: int, num_proposed: int) -> None:
        pass

    def end(self) -> None:
        pass


@dataclass
class GpuBenchConfig:
    methods: Sequence[str] = DEFAULT_GPU_METHODS
    max_tokens: int = 128
    k_max: int = 32
    draft_k_max: int = 16
    time_budget: float | None = None  # seconds; methods not started by then are skipped (and said so)
    extra: dict = field(default_factory=dict)


def copy_bandwidth(device: torch.device, megabytes: int = 1024, repeats: int = 10) -> float | None:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (None off CUDA)."""
    if device.type != "cuda":
        return None
    n = megabytes * (1 << 20) // 2
    src = torch.randn(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) / 1000)
    del src, dst
    return 2 * n * 2 / statistics.median(times)


def environment(device: torch.device) -> dict:
    import transformers  # slow to import: here, not at CLI start

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "device": str(device), "platform": platform.platform()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=torch.cuda.get_device_name(device), gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   multiprocessors=props.multi_processor_count, cuda=torch.version.cuda)
        try:
            env["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm",
                                                "--format=csv,noheader"], capture_output=True, text=True,
                                               timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            env["nvidia_smi"] = f"unavailable: {exc}"
    return env


class GpuBench:
    """Runs the methods over prompts on one target (and optional draft) TransformersBackend pair."""

    def __init__(self, target, draft, prompts: list[tuple[str, list[int]]], config: GpuBenchConfig,
                 log: Callable[[str], None] | None = None):
        self.target, self.draft, self.prompts, self.config = target, draft, prompts, config
        self.device = target.device
        self.log = log or (lambda message: print(message, file=sys.stderr, flush=True))
        self.references: dict[tuple[int, ...], list[int]] = {}
        self.engines: dict[str, SpeculativeEngine] = {}
        self.began = time.perf_counter()

    # -- methods ------------------------------------------------------------------------------------------

    def engine(self, method: str) -> SpeculativeEngine:
        if method not in self.engines:
            k_max, draft_k_max = self.config.k_max, self.config.draft_k_max
            if method == "plain":
                drafter, spec = None, SpecConfig(drafter="none")
            elif method == "replay_k8":
                drafter, spec = ReplayDrafter(self.references), SpecConfig(8, drafter="replay", k_policy="fixed")
            elif method == "lookup_adaptive":
                spec = SpecConfig(k_max, drafter="prompt_lookup", k_policy="adaptive")
                drafter = create_drafter("prompt_lookup", spec=spec)
            elif method == "draft_k4":
                spec = SpecConfig(4, drafter="draft_model", k_policy="fixed")
                drafter = create_drafter("draft_model", draft_backend=self.draft, spec=spec)
            elif method == "draft_adaptive":
                spec = SpecConfig(draft_k_max, drafter="draft_model", k_policy="adaptive")
                drafter = create_drafter("draft_model", draft_backend=self.draft, spec=spec)
            else:
                raise ValueError(f"not an engine method: {method}")
            self.engines[method] = SpeculativeEngine(self.target, drafter, spec, decode=lambda ids: "")
        return self.engines[method]

    def run_once(self, method: str, prompt: list[int], max_tokens: int) -> dict:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.target.synchronize()
        began = time.perf_counter()
        if method.startswith("hf_"):
            mode = {"hf_eager": "plain", "hf_static": "plain", "hf_assisted_k4": "assisted",
                    "hf_prompt_lookup": "prompt_lookup"}[method]
            run = hf_generate(
                self.target.model, prompt, params, (), mode=mode,
                draft_model=self.draft.model if self.draft is not None else None,
                num_assistant_tokens=4 if mode == "assisted" else None,
                lookup_tokens=10 if mode == "prompt_lookup" else None, lookup_ngram=2 if mode == "prompt_lookup" else None,
                pad_token_id=0, cache_implementation="static" if method == "hf_static" else None,
            )
            tokens, stats = run.tokens, run.stats
        else:
            generation = self.engine(method).generate(prompt, params)
            tokens, stats = generation.tokens, generation.stats
        self.target.synchronize()
        seconds = time.perf_counter() - began
        return {"method": method, "tokens": tokens, "seconds": seconds, "generated": len(tokens),
                "steps": stats.num_target_forwards, "drafted": stats.num_draft_tokens,
                "accepted": stats.num_accepted_tokens, "target_seconds": stats.target_seconds,
                "draft_seconds": stats.draft_seconds, "prefill_seconds": stats.prefill_seconds}

    # -- the run ------------------------------------------------------------------------------------------

    def eager_layer_curves(self, sizes=(1, 2, 4, 8, 16)) -> dict:
        """The same passes with eager layers (no torch.compile) in graphs of their own: what the
        compile buys, measured in this run."""
        curves = {}
        for role, backend in (("target", self.target), ("draft", self.draft)):
            decoder = getattr(backend, "decoder", None)
            if decoder is None or not decoder.compile_layers:
                continue
            self.log(f"pass-cost curve of the {role} with eager layers")
            decoder.set_layers_compiled(False)
            try:
                cache = backend.new_cache(backend.max_context)
                curves[role] = {str(s): c for s, c in measure_pass_costs(backend, sizes, cache=cache).items()}
            finally:
                decoder.set_layers_compiled(True)
        return curves

    def over_budget(self) -> bool:
        budget = self.config.time_budget
        return budget is not None and time.perf_counter() - self.began > budget

    def run(self) -> dict:
        config = self.config
        methods = [m for m in config.methods if self.draft is not None or m not in NEEDS_DRAFT]
        skipped = {m: "no draft model" for m in config.methods if m not in methods}
        if "plain" not in methods:
            methods.insert(0, "plain")
        results: dict = {"environment": environment(self.device), "config": dict(config.extra)}
        bandwidth = copy_bandwidth(self.device)
        results["copy_bandwidth_bytes_per_s"] = bandwidth
        results["curves"] = {}
        for role, backend in (("target", self.target), ("draft", self.draft)):
            if backend is None:
                continue
            self.log(f"pass-cost curve of the {role} ({backend.runtime})")
            engine = SpeculativeEngine(backend, None, SpecConfig(drafter="none"))
            results["curves"][role] = {str(s): c for s, c in engine.calibrate(CURVE_SIZES).items()}
            results["curve_context_tokens"] = fitting_context(engine.cache.capacity)
            if role == "target":
                self.target.pass_costs = {int(s): c for s, c in results["curves"][role].items()}
                self.engines["plain"] = engine  # reuse its cache and graphs
        results["curves_eager_layers"] = self.eager_layer_curves()
        results["compile_seconds"] = {role: getattr(b.decoder, "compile_seconds", None)
                                      for role, b in (("target", self.target), ("draft", self.draft))
                                      if b is not None and getattr(b, "decoder", None) is not None}
        if self.device.type == "cuda" and self.target.decoder is not None:
            results["kernel_profile"] = {"target": kernel_profile(self.target, self.engines["plain"].cache)}
            if self.draft is not None and self.draft.decoder is not None:
                results["kernel_profile"]["draft"] = kernel_profile(self.draft, self.draft.new_cache(64))
        # Plain decoding first on every prompt: its outputs are the replay drafter's references.
        self.log("warm-up and plain references")
        self.run_once("plain", self.prompts[0][1], WARMUP_TOKENS)
        runs: list[dict] = []
        for kind, prompt in self.prompts:
            record = self.run_once("plain", prompt, config.max_tokens)
            record.update(kind=kind, prompt_tokens=len(prompt), timed=False)
            self.references[tuple(prompt)] = record["tokens"]
        warm: set[str] = set()
        first_call_seconds: dict[str, float] = {}
        prompts_run = 0
        for index, (kind, prompt) in enumerate(self.prompts):
            if index > 0 and self.over_budget():
                # Stop at a prompt boundary, so every method ran on the same prompts.
                self.log(f"time budget of {config.time_budget:.0f} s spent: {index} of {len(self.prompts)} prompts run")
                break
            prompts_run += 1
            order = methods[index % len(methods):] + methods[: index % len(methods)]
            for method in order:
                if method in skipped:
                    continue
                if method not in warm:
                    # transformers' static cache is sized by the call's length, and a new size recompiles:
                    # its warm-up (the compile) runs at the timed length.
                    warmup_tokens = config.max_tokens if method == "hf_static" else WARMUP_TOKENS
                    try:
                        first_call_seconds[method] = self.run_once(method, self.prompts[0][1], warmup_tokens)["seconds"]
                    except Exception as exc:  # a peer that cannot run here is reported, not fatal
                        skipped[method] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                        self.log(f"skipping {method}: {skipped[method]}")
                        continue
                    warm.add(method)
                record = self.run_once(method, prompt, config.max_tokens)
                record.update(kind=kind, prompt_index=index, prompt_tokens=len(prompt))
                reference = self.references[tuple(prompt)]
                record["identical_to_plain"] = record["tokens"] == reference
                runs.append(record)
                self.log(f"prompt {index} {method}: {record['generated'] / record['seconds']:.1f} tok/s")
        for run in runs:
            run.pop("tokens")
        results["runs"] = runs
        results["prompts_run"] = prompts_run
        results["first_call_seconds"] = first_call_seconds
        results["skipped"] = skipped
        results["policies"] = {name: _policy_snapshots(engine) for name, engine in self.engines.items()}
        results["weights"] = {"target_bytes": weight_bytes(self.target.model),
                              "draft_bytes": weight_bytes(self.draft.model) if self.draft is not None else None}
        results["runtime"] = {"target": self.target.runtime, "draft": self.draft.runtime if self.draft else None}
        if self.device.type == "cuda":
            results["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)
        results["wall_seconds"] = round(time.perf_counter() - self.began, 1)
        return results


def kernel_profile(backend, cache, rows: int = 1) -> dict:
    """Kernels one eager static pass of `rows` rows launches and their summed device time (what a graph replays)."""
    try:
        with torch.inference_mode():
            backend.decoder._compute(cache, rows, 0)  # warm
            backend.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                backend.decoder._compute(cache, rows, 0)
                backend.synchronize()
        averages = prof.key_averages()
        def device_us(event):
            return float(getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0))
        kernels = [e for e in averages if device_us(e) > 0]
        top = sorted(kernels, key=device_us, reverse=True)[:10]
        return {"rows": rows, "kernels": int(sum(e.count for e in kernels)),
                "device_ms": round(sum(device_us(e) for e in kernels) / 1000, 3),
                "top": [{"name": e.key[:90], "count": e.count, "ms": round(device_us(e) / 1000, 3)} for e in top]}
    except Exception as exc:  # the profiler is a diagnosis, never a reason to lose the bench
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        cache.trim(cache.length)


def _policy_snapshots(engine: SpeculativeEngine) -> dict:
    return {str(source): policy.snapshot() for source, policy in engine.adaptive_policies.items()}


__all__ = ["CURVE_SIZES", "DEFAULT_GPU_METHODS", "GPU_METHODS", "GpuBench", "GpuBenchConfig", "ReplayDrafter",
           "copy_bandwidth", "environment", "kernel_profile"]
