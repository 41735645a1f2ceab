"""`specdec bench --serve`: our server and llama-server under concurrent streaming chat requests, one by one.

Systems (each run one at a time: never two servers generating at once, and a fresh server for every
concurrency level, so no level sees the prompts, prefix caches or cross-request suffix caches of another):
- `reference`: `specdec serve --drafter none --exact` at concurrency 1; its texts are what every other
  stream is compared with (plain decoding on the exact kernels, solo);
- `ours`: `specdec serve --parallel C` (its default drafter and kernels);
- `ours_exact`: `specdec serve --exact --parallel C`: every stream must equal the reference's;
- `ours_serial`: `specdec serve --parallel 1` at every concurrency: today's one-at-a-time server, the
  baseline of the issue's goal;
- `llamacpp_plain`, `llamacpp_ngram`: `llama-server -np C` (plain, and `--spec-type ngram-simple`).
Every server gets the same model (llama-server the target's GGUF), the same threads and the same context
per stream (llama-server's `-c` is C times ours: it splits its context between its C slots). Until
`specdec serve` has `--parallel` (detected from its --help), `ours` and `ours_exact` run without it, and
`ours` is then the one-at-a-time server itself. Load generation: serving_client.py; tables and plot:
serving/report.py.
"""

from __future__ import annotations

import functools
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specdec.bench.datasets import BenchPrompt
from specdec.bench.llamacpp_peer import (
    OPTIONAL_FLAGS,
    SERVER_BINARY,
    log_tail,
    missing_reason,
    server_flags,
    stop_server,
    wait_healthy,
)
from specdec.bench.serving.client import RssSampler, cpu_count, run_level, vm_hwm, warm_up
from specdec.bench.serving.report import summarise, summarise_level
from specdec.bench.serving.systems import LLAMACPP_SYSTEMS, REFERENCE, REFERENCE_DESCRIPTION, SYSTEMS
from specdec.config import ConfigError
from specdec.host.hugepages import environment_as_given
from specdec.host.native_build import cpu_flags, cpu_model
from specdec.version import __version__

DEFAULT_CONCURRENCY = "1,2,4,8"
START_TIMEOUT = 300.0  # loading a model pair on a busy 2-core machine
WARMUP_TOKENS = 16


@dataclass
class ServeOptions:
    """What every system shares: the model, threads, context per stream, and the request shape."""

    model_args: list[str]  # our server's model flags (target, --draft, --backend, ...), without --threads
    threads: int
    max_context: int  # tokens per stream
    max_tokens: int
    concurrency: tuple[int, ...]
    systems: tuple[str, ...]
    target_gguf: Path | None = None  # llama-server's model
    llamacpp_bin: Path | None = None
    request_timeout: float = 600.0
    start_timeout: float = START_TIMEOUT
    parallel: bool | None = None  # specdec serve has --parallel (None: ask its --help)
    extra: dict = field(default_factory=dict)  # recorded in results.json as given


def parse_concurrency(text: str | int) -> tuple[int, ...]:
    """'1,2,4,8' -> (1, 2, 4, 8), each >= 1, repeats dropped, in the order given."""
    parts = [str(text)] if isinstance(text, int) else [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ConfigError(f"--concurrency must be a comma list of positive integers (e.g. 1,2,4,8), "
                          f"got {text!r}")
    return tuple(dict.fromkeys(int(p) for p in parts))


def parse_systems(text: str | None) -> tuple[str, ...]:
    """'ours,llamacpp_plain' -> the systems, refusing unknown names (default: all of them)."""
    if text is None:
        return tuple(SYSTEMS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise ConfigError(f"--systems: unknown {unknown[0] if unknown else 'empty list'!r}; choose from "
                          f"{', '.join(SYSTEMS)} (the reference always runs)")
    return tuple(dict.fromkeys(names))


@functools.lru_cache(maxsize=1)
def serve_supports_parallel() -> bool:
    """Whether this `specdec serve` lists --parallel in its --help."""
    try:
        done = subprocess.run([sys.executable, "-m", "specdec.cli.main", "serve", "--help"], check=False,
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return False
    return re.search(r"(?<![\w-])--parallel\b", done.stdout) is not None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def our_command(options: ServeOptions, system: str, concurrency: int, port: int, parallel: bool) -> list[str]:
    """`specdec serve` for one system at one concurrency (python -m, so it is this install's)."""
    command = [sys.executable, "-m", "specdec.cli.main", "serve", *options.model_args,
               "--threads", str(options.threads), "--max-context", str(options.max_context),
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    if system == REFERENCE:
        return command + ["--drafter", "none", "--exact"]
    if system == "ours_exact":
        command.append("--exact")
    slots = 1 if system == "ours_serial" else concurrency
    if parallel:
        command += ["--parallel", str(slots)]
    return command


def llama_command(options: ServeOptions, system: str, concurrency: int, port: int) -> list[str]:
    """llama-server with C slots, each with our context per stream; optional flags only where listed."""
    binary = options.llamacpp_bin / SERVER_BINARY
    flags = server_flags(str(binary))
    optional = [arg for option in OPTIONAL_FLAGS if option[0] in flags for arg in option]
    command = [str(binary), "-m", str(options.target_gguf),
               "-t", str(options.threads), "-tb", str(options.threads),
               "-c", str(options.max_context * concurrency), "-np", str(concurrency),
               "--host", "127.0.0.1", "--port", str(port), *optional]
    if system == "llamacpp_ngram":
        command += ["--spec-type", "ngram-simple"]
    return command


def skip_reasons(options: ServeOptions, parallel: bool) -> dict[str, str]:
    """Systems that cannot run here, and why (reported, never silently dropped)."""
    reasons: dict[str, str] = {}
    llama = [s for s in options.systems if s in LLAMACPP_SYSTEMS]
    if llama:
        why = missing_reason(options.llamacpp_bin, options.target_gguf)
        if why is None and "llamacpp_ngram" in llama:
            flags = server_flags(str(options.llamacpp_bin / SERVER_BINARY))
            if flags and "--spec-type" not in flags:
                reasons["llamacpp_ngram"] = f"this {SERVER_BINARY} has no --spec-type option"
        for system in llama:
            if why is not None:
                reasons[system] = why
    if "ours_serial" in options.systems and not parallel:
        reasons["ours_serial"] = ("specdec serve has no --parallel yet: `ours` runs without it and is "
                                  "today's one-at-a-time server")
    return reasons


class ServerProcess:
    """A server subprocess on 127.0.0.1 in its own session, its log in a temporary file; ready once /health
    answers 200. close() stops it (SIGTERM, then SIGKILL after 15 s) and is safe to call twice."""

    def __init__(self, command: list[str], port: int, timeout: float):
        self.command = command
        self.url = f"http://127.0.0.1:{port}"
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the server
        try:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            env=environment_as_given())  # as the user started us
        except OSError:
            self._log.close()
            raise
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 5) -> str:
        return log_tail(self._log, lines)

    def _wait_healthy(self, timeout: float) -> None:
        try:
            status = wait_healthy(self.process, self.url, timeout)
        except TimeoutError:
            raise RuntimeError(f"not healthy within {timeout:.0f} s: {self.log_tail()}") from None
        if status is not None:
            raise RuntimeError(f"exited with status {status}: {self.log_tail()}")

    def close(self) -> None:
        stop_server(self.process, self._log, 15)


def run_one_level(options: ServeOptions, system: str, concurrency: int, prompts: Sequence[BenchPrompt],
                  parallel: bool) -> dict:
    """Start the system's server for this level, warm it up, run the level, stop it: the level's record."""
    port = free_port()
    if system in LLAMACPP_SYSTEMS:
        command, extra = llama_command(options, system, concurrency, port), {"top_k": 1}
    else:
        command, extra = our_command(options, system, concurrency, port, parallel), None
    level: dict = {"system": system, "concurrency": concurrency, "command": command, "status": "ok",
                   "records": []}
    began = time.perf_counter()
    try:
        server = ServerProcess(command, port, options.start_timeout)
    except Exception as exc:  # noqa: BLE001 - a system that cannot start is reported, not fatal
        level.update(status="failed_to_start", error=str(exc)[:500])
        return level
    level["start_seconds"] = round(time.perf_counter() - began, 2)
    sampler = RssSampler(server.pid)
    try:
        warm = warm_up(server.url, min(WARMUP_TOKENS, options.max_tokens), options.request_timeout, extra)
        level["warmup"] = {"ok": warm.ok, "error": warm.error, "e2e": warm.e2e}
        if not warm.ok:
            level.update(status="warmup_failed",
                         error=f"warm-up request failed: {warm.error}; {server.log_tail()}")
            return level
        sampler.window()
        records, wall = run_level(server.url, prompts, concurrency, options.max_tokens,
                                  timeout=options.request_timeout, extra=extra)
        sampler.stop()
        level["records"] = [r.to_dict() for r in records]
        level["wall_seconds"] = wall
        level["peak_rss_bytes"] = sampler.window_peak or None
        level["server_peak_rss_bytes"] = sampler.peak or None
        level["vmhwm_bytes"] = vm_hwm(server.pid)
        if any(not r.ok for r in records):
            level["log_tail"] = server.log_tail(10)
    finally:
        sampler.stop()
        server.close()
    return level


def level_plan(systems: Sequence[str], concurrency: Sequence[int]) -> list[tuple[str, int]]:
    """The order the levels run in: the reference first, then per concurrency level every system, the order rotated
    by one system per level (as the method bench rotates its methods per prompt), so that the machine's drift over
    a run (on the 2-vCPU VM the same system at the same level measured 20% apart in two runs) does not always meet
    the same system first."""
    plan = [(REFERENCE, 1)]
    for index, level in enumerate(concurrency):
        shift = index % len(systems) if systems else 0
        plan += [(system, level) for system in [*systems[shift:], *systems[:shift]]]
    return plan


def run_serving_bench(prompts: Sequence[BenchPrompt], options: ServeOptions,
                      log: Callable[[str], None] | None = None) -> dict:
    """The reference, then every concurrency level of every system (systems interleaved per level, their order
    rotated per level: level_plan), each on a fresh server, one at a time; the raw results with their summary
    (serving/report.summarise)."""
    say = log or (lambda message: print(message, file=sys.stderr, flush=True))
    parallel = serve_supports_parallel() if options.parallel is None else options.parallel
    skipped = skip_reasons(options, parallel)
    if not parallel:
        say("specdec serve has no --parallel: our systems run without it (one request at a time)")
    for system, reason in skipped.items():
        say(f"skipping {system}: {reason}")
    began = time.perf_counter()
    levels = []
    plan = level_plan([s for s in options.systems if s not in skipped], options.concurrency)
    for number, (system, concurrency) in enumerate(plan, 1):
        say(f"[{number}/{len(plan)}] {system} at concurrency {concurrency}: {len(prompts)} requests")
        level = run_one_level(options, system, concurrency, prompts, parallel)
        failures = sum(1 for r in level["records"] if r["error"] is not None)
        if level["status"] != "ok":
            say(f"  {system}: {level['status']}: {level.get('error')}")
        else:
            row = summarise_level(level, {})
            rate = f"{row['tok_per_s']:.1f} tok/s" if row["tok_per_s"] is not None else "tokens not counted"
            ttft = f"{row['ttft_p50']:.2f} s" if row["ttft_p50"] is not None else "-"
            say(f"  {rate}, TTFT p50 {ttft}, {failures} of {len(prompts)} requests failed")
        levels.append(level)
    results = {
        "config": {
            "systems": {REFERENCE: REFERENCE_DESCRIPTION, **{s: SYSTEMS[s] for s in options.systems}},
            "concurrency": list(options.concurrency), "threads": options.threads,
            "max_context_per_stream": options.max_context, "max_tokens": options.max_tokens,
            "greedy": True, "request_timeout": options.request_timeout, "num_prompts": len(prompts),
            "prompts": [{"task": p.task, "id": p.id} for p in prompts], "specdec_serve_parallel": parallel,
            "target_gguf": str(options.target_gguf) if options.target_gguf else None,
            "llamacpp_bin": str(options.llamacpp_bin) if options.llamacpp_bin else None, **options.extra,
        },
        "environment": serving_environment(options),
        "skipped_systems": skipped,
        "levels": levels,
        "wall_seconds": time.perf_counter() - began,
    }
    results["summary"] = summarise(results)
    return results


def lscpu() -> dict[str, str]:
    """lscpu's fields (model name, flags, sockets, threads per core...), {} where there is no lscpu."""
    binary = shutil.which("lscpu")
    if binary is None:
        return {}
    try:
        done = subprocess.run([binary], check=False, capture_output=True, text=True, timeout=30,
                              env={"LC_ALL": "C"})
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = {}
    for line in done.stdout.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def serving_environment(options: ServeOptions) -> dict:
    """Versions and hardware (the bench's fields where they apply), and llama-server's version."""
    info = lscpu()
    env = {
        "specdec": __version__, "python": platform.python_version(), "platform": platform.platform(),
        "machine": platform.machine(), "cpu_model": info.get("Model name") or cpu_model(),
        "cpu_flags": info.get("Flags") or " ".join(sorted(cpu_flags())), "cpu_count": cpu_count(),
        "lscpu": {k: v for k, v in info.items() if k != "Flags"}, "threads": options.threads,
        "argv": sys.argv[1:],
    }
    try:
        import llama_cpp  # the llamacpp extra: its version is recorded where installed

        env["llama_cpp_python"] = llama_cpp.__version__
    except (ImportError, OSError, RuntimeError):
        env["llama_cpp_python"] = None
    binary = options.llamacpp_bin / SERVER_BINARY if options.llamacpp_bin else None
    if binary is not None and binary.is_file():
        try:
            done = subprocess.run([str(binary), "--version"], check=False, capture_output=True, text=True,
                                  timeout=60)
            env["llama_server_version"] = (done.stdout + done.stderr).strip()[-300:]
        except (OSError, subprocess.SubprocessError):
            env["llama_server_version"] = None
    return env


__all__ = [
    "DEFAULT_CONCURRENCY", "LLAMACPP_SYSTEMS", "REFERENCE", "SYSTEMS", "ServeOptions", "ServerProcess",
    "llama_command", "our_command", "parse_concurrency", "parse_systems", "run_one_level",
    "run_serving_bench", "serve_supports_parallel", "skip_reasons",
]
