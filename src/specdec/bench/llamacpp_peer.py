"""llama.cpp's `llama-server` as a bench peer: a subprocess per configuration, fed our token ids over HTTP.

The peer is what a llama.cpp user would run instead of specdec: the same GGUF files, the same llama.cpp
version as the binding (its binaries are built from the same llama-cpp-python sdist), the same threads.
Prompts go to `/completion` as token ids, so llama.cpp sees exactly the ids our engine sees; the time of
a run is the wall time of the HTTP call (prefill included, like ours), and llama-server's own `timings`
(prompt/decode speed, draft_n, draft_n_accepted) are recorded beside it. One server process runs per
configuration (plain, draft model, n-gram), started on first use and stopped when the benchmark ends.
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specdec.config import SamplingParams
from specdec.core.stats import SpecStats
from specdec.host.hugepages import environment_as_given
from specdec.host.paths import cache_dir
from specdec.loading.models import ModelLoadError, resolve

SERVER_BINARY = "llama-server"
DEFAULT_VERSION = "0.3.36"
START_TIMEOUT = 180.0  # loading two GGUF files on a busy 2-core machine
# Flags added only when this build lists them in --help (they come and go between llama.cpp versions):
# no web UI to serve, warnings and errors only in the log (kept for error messages), and no host-RAM
# prompt cache: with cache_prompt false it is never reused, yet every new request would copy the previous
# slot's KV state into it inside the timed call.
OPTIONAL_FLAGS = (("--no-webui",), ("--log-verbosity", "2"), ("--cache-ram", "0"))


class PeerError(RuntimeError):
    """llama-server could not be started or answered badly; the message (one line) says why."""


def binaries_dir(explicit: str | None = None) -> Path:
    """Where llama-server lives: --llamacpp-bin, $SPECDEC_LLAMACPP_BIN, else the build script's cache dir."""
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get("SPECDEC_LLAMACPP_BIN"):
        return Path(os.environ["SPECDEC_LLAMACPP_BIN"]).expanduser()

    try:
        import llama_cpp  # the llamacpp extra: its version names the llama.cpp build the peers match

        version = llama_cpp.__version__
    except (ImportError, OSError, RuntimeError):
        version = DEFAULT_VERSION
    return cache_dir() / f"llama.cpp-{version}" / "bin"


def gguf_files(
    decoder, target_ref: str | None = None, draft_ref: str | None = None,
) -> tuple[Path | None, Path | None]:
    """The GGUF files of the decoder's target and draft: the llama.cpp backends' own, else the references'.

    A torch backend loaded from a .gguf (or the packaged default pair) keeps no path, so the reference the
    user gave is resolved again; anything that is not a GGUF file gives None.
    """
    def one(backend, reference: str | None, role: str) -> Path | None:
        if backend is None:
            return None
        path = backend.gguf_path
        if path is not None:
            return Path(path)
        if not reference:
            return None

        try:
            resolved = resolve(f"default-{role}" if reference == "default" else reference)
        except (ModelLoadError, OSError):
            return None
        return Path(resolved.source) / resolved.gguf_file if resolved.gguf_file else None

    return one(decoder.target, target_ref, "target"), one(decoder.draft, draft_ref, "draft")


def missing_reason(bin_dir: Path | None, target_gguf: Path | None) -> str | None:
    """Why llama.cpp's peers cannot run here, or None."""
    if target_gguf is None:
        return "the target is not a GGUF file"
    binary = bin_dir / SERVER_BINARY if bin_dir is not None else None
    if binary is None or not binary.is_file() or not os.access(binary, os.X_OK):
        return (f"{SERVER_BINARY} not found in {bin_dir} (build it from the llama-cpp-python sdist, see "
                f"docs/bench.md, or point --llamacpp-bin / $SPECDEC_LLAMACPP_BIN at it)")
    return None


@functools.lru_cache(maxsize=8)
def server_flags(binary: str) -> frozenset[str]:
    """The options this llama-server build lists in --help; empty when --help cannot be read."""
    try:
        done = subprocess.run([binary, "--help"], check=False, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", done.stdout + done.stderr))


@dataclass(frozen=True)
class PeerConfig:
    """One llama-server configuration: mode 'plain', 'spec' (draft-simple) or 'ngram' (ngram-simple)."""

    mode: str
    draft_max: int | None = None  # --spec-draft-n-max; None: llama.cpp's default (3)

    def server_args(self, draft_gguf: Path | None, threads: int) -> list[str]:
        if self.mode == "plain":
            return []
        if self.mode == "ngram":
            return ["--spec-type", "ngram-simple"]
        if draft_gguf is None:
            raise PeerError("llama.cpp's draft-model speculation needs a draft GGUF")
        args = ["-md", str(draft_gguf), "--spec-type", "draft-simple"]
        args += ["-td", str(threads), "-tbd", str(threads)]
        if self.draft_max is not None:
            args += ["--spec-draft-n-max", str(self.draft_max)]
        return args


@dataclass
class PeerRun:
    tokens: list[int]
    seconds: float
    finish_reason: str
    stats: SpecStats
    settings: dict


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(binary: Path, target_gguf: Path, config: PeerConfig, port: int, *, draft_gguf: Path | None,
                   threads: int, context: int) -> list[str]:
    """The llama-server command line of one configuration (optional flags only where this build has them)."""
    flags = server_flags(str(binary))
    speculative = config.server_args(draft_gguf, threads)
    if speculative and flags and "--spec-type" not in flags:
        raise PeerError(f"{binary} has no --spec-type option: build llama.cpp from the installed "
                        f"llama-cpp-python's sdist (see docs/bench.md)")
    optional = [arg for option in OPTIONAL_FLAGS if option[0] in flags for arg in option]
    return [
        str(binary), "-m", str(target_gguf), "-t", str(threads), "-tb", str(threads), "-c", str(context),
        "-np", "1", "--host", "127.0.0.1", "--port", str(port), *optional, *speculative,
    ]


class LlamaServer:
    """One llama-server process on 127.0.0.1 with a single slot; `complete` sends token ids to /completion."""

    def __init__(self, bin_dir: Path, target_gguf: Path, config: PeerConfig, *,
                 draft_gguf: Path | None = None, threads: int = 1, context: int = 4096,
                 start_timeout: float = START_TIMEOUT):
        self.config = config
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = server_command(bin_dir / SERVER_BINARY, target_gguf, config, self.port,
                                      draft_gguf=draft_gguf, threads=threads, context=context)
        # The log lives as long as the server; its tail goes into error messages.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115
        # Its own session: a Ctrl-C reaches only us, and close() (always run) stops the server.
        self._process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=self._log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env=environment_as_given())  # not our huge-page tunable
        try:
            self._wait_healthy(start_timeout)
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def running(self) -> bool:
        return self._process.poll() is None

    def _log_tail(self) -> str:
        return log_tail(self._log, 3)

    def _wait_healthy(self, timeout: float) -> None:
        # /health answers 503 while the model loads, 200 once it can serve.
        try:
            status = wait_healthy(self._process, self.url, timeout)
        except TimeoutError:
            raise PeerError(f"{SERVER_BINARY} did not become healthy within {timeout:.0f}s "
                            f"({' '.join(self.command[:3])} ...): {self._log_tail()}") from None
        if status is not None:
            raise PeerError(f"{SERVER_BINARY} exited with status {status}: {self._log_tail()}")

    def request_body(self, prompt_ids: Sequence[int], params: SamplingParams) -> dict:
        """The /completion request: token ids in, token ids out, no prompt reuse between requests."""
        body = {
            "prompt": [int(t) for t in prompt_ids], "n_predict": params.max_tokens, "cache_prompt": False,
            "return_tokens": True, "stream": False,
        }
        if params.ignore_eos:
            body["ignore_eos"] = True  # llama-server bans end-of-generation tokens; ours generates them
        if params.greedy:
            body.update(temperature=0.0, top_k=1)
        else:
            # Every sampler spelled out: llama-server's own defaults (min_p 0.05, top_k 40) are not ours.
            body.update(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                        min_p=params.min_p)
            if params.seed is not None:
                body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        return body

    def complete(self, prompt_ids: Sequence[int], params: SamplingParams, timeout: float = 1800.0) -> PeerRun:
        body = self.request_body(prompt_ids, params)
        request = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        began = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                answer = json.loads(response.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError) as exc:
            raise PeerError(f"{SERVER_BINARY} request failed: {exc}; {self._log_tail()}") from exc
        seconds = time.perf_counter() - began
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list) or (params.max_tokens > 0 and not tokens and answer.get("content")):
            raise PeerError(f"{SERVER_BINARY} returned no token ids (too old for return_tokens?): "
                            f"{str(answer)[:200]}")
        timings = answer.get("timings") or {}
        stats = SpecStats(num_prompt_tokens=len(prompt_ids))
        stats.num_generated_tokens = len(tokens)
        # draft_n / draft_n_accepted appear only once something was drafted.
        stats.num_draft_tokens = int(timings.get("draft_n") or 0)
        stats.num_accepted_tokens = int(timings.get("draft_n_accepted") or 0)
        stats.prefill_seconds = float(timings.get("prompt_ms") or 0.0) / 1000
        stats.total_seconds = seconds
        finish = "length" if answer.get("stop_type") == "limit" or answer.get("truncated") else "stop"
        settings = {"server_args": self.command[1:], "stop_type": answer.get("stop_type"), "timings": timings}
        return PeerRun([int(t) for t in tokens], seconds, finish, stats, settings)

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s); safe to call twice."""
        stop_server(self._process, self._log, 10)


def wait_healthy(process: subprocess.Popen, url: str, timeout: float) -> int | None:
    """Poll url/health every 0.2 s until it answers 200 (None), or return the process's exit status if it exits
    first; TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return process.returncode
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout:.0f} s")


def log_tail(log, lines: int) -> str:
    """The last lines of a server's log file, joined by ' | ' (for error messages)."""
    if log.closed:
        return "no log"
    log.seek(0)
    text = log.read().decode("utf-8", "replace").strip().splitlines()
    return " | ".join(line.strip() for line in text[-lines:]) if text else "no output"


def stop_server(process: subprocess.Popen, log, grace: float) -> None:
    """Stop a server process (SIGTERM, then SIGKILL after `grace` seconds) and close its log; safe to call twice."""
    try:
        if process.poll() is None:
            process.terminate()
            process.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    finally:
        # Also when interrupted while waiting: no server outlives the benchmark.
        if process.poll() is None:
            process.kill()
            process.wait(grace)
        log.close()


class PeerPool:
    """The llama-server processes of one benchmark, one per configuration, started on first use."""

    def __init__(self, bin_dir: Path, target_gguf: Path, draft_gguf: Path | None, threads: int, context: int):
        self.bin_dir, self.target_gguf, self.draft_gguf = bin_dir, target_gguf, draft_gguf
        self.threads, self.context = threads, context
        self._servers: dict[PeerConfig, LlamaServer] = {}

    def run(self, config: PeerConfig, prompt_ids: Sequence[int], params: SamplingParams) -> PeerRun:
        server = self._servers.get(config)
        if server is None:
            server = LlamaServer(self.bin_dir, self.target_gguf, config, draft_gguf=self.draft_gguf,
                                 threads=self.threads, context=self.context)
            self._servers[config] = server
        return server.complete(prompt_ids, params)

    def close(self) -> None:
        servers, self._servers = list(self._servers.values()), {}
        _close_all(servers)


def _close_all(servers: list[LlamaServer]) -> None:
    # Every server is stopped even when stopping one is interrupted (a second Ctrl-C) or fails.
    if servers:
        try:
            servers[0].close()
        finally:
            _close_all(servers[1:])


__all__ = [
    "LlamaServer", "PeerConfig", "PeerError", "PeerPool", "PeerRun", "binaries_dir", "gguf_files",
    "missing_reason", "server_command", "server_flags",
]
