"""llama.cpp's own programs as benchmark peers: `llama-server` run as a subprocess and driven over HTTP with our token ids.

The peer is what a llama.cpp user would run instead of specdec: the same GGUF files, the same llama.cpp
version as the binding (its binaries are built from the same llama-cpp-python sdist), the same threads.
Prompts go to `/completion` as token ids, so llama.cpp sees exactly the ids our engine sees; the time of
a run is the wall time of the HTTP call (prefill included, like ours), and llama-server's own `timings`
(prompt/decode speed, draft_n, draft_n_accepted) are recorded beside it. One server process runs per
configuration (plain, draft model, n-gram), started on first use and stopped when the benchmark ends.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..config import SamplingParams
from ..metrics import SpecStats

SERVER_BINARY = "llama-server"
DEFAULT_VERSION = "0.3.36"
START_TIMEOUT = 180.0  # loading two GGUF files on a busy 2-core machine


class PeerError(RuntimeError):
    """llama-server could not be started or answered badly; the message says why."""


def binaries_dir(explicit: str | None = None) -> Path | None:
    """Where llama-server lives: --llamacpp-bin, $SPECDEC_LLAMACPP_BIN, else the cache folder the build script fills."""
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get("SPECDEC_LLAMACPP_BIN"):
        return Path(os.environ["SPECDEC_LLAMACPP_BIN"]).expanduser()
    from ..models import cache_dir

    try:
        import llama_cpp

        version = llama_cpp.__version__
    except (ImportError, OSError, RuntimeError):
        version = DEFAULT_VERSION
    return cache_dir() / f"llama.cpp-{version}" / "bin"


def missing_reason(bin_dir: Path | None, target_gguf: Path | None) -> str | None:
    """Why llama.cpp's peers cannot run here, or None."""
    if target_gguf is None:
        return "the target is not a GGUF file"
    if bin_dir is None or not (bin_dir / SERVER_BINARY).is_file():
        return (f"{SERVER_BINARY} not found in {bin_dir} (build it from the llama-cpp-python sdist, see "
                f"docs/bench.md, or point --llamacpp-bin at it)")
    return None


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
        args = ["-md", str(draft_gguf), "--spec-type", "draft-simple", "-td", str(threads), "-tbd", str(threads)]
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


class LlamaServer:
    """One llama-server process on 127.0.0.1 with a single slot; `complete` sends token ids to /completion."""

    def __init__(self, bin_dir: Path, target_gguf: Path, config: PeerConfig, *, draft_gguf: Path | None = None,
                 threads: int = 1, context: int = 4096, start_timeout: float = START_TIMEOUT):
        self.config = config
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [
            str(bin_dir / SERVER_BINARY), "-m", str(target_gguf), "-t", str(threads), "-tb", str(threads),
            "-c", str(context), "-np", "1", "--host", "127.0.0.1", "--port", str(self.port), "--no-webui",
            *config.server_args(draft_gguf, threads),
        ]
        self._log = tempfile.TemporaryFile()
        self._process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy(start_timeout)
        except BaseException:
            self.close()
            raise

    def _log_tail(self) -> str:
        self._log.seek(0)
        lines = self._log.read().decode("utf-8", "replace").strip().splitlines()
        return " | ".join(lines[-3:]) if lines else "no output"

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise PeerError(f"{SERVER_BINARY} exited with status {self._process.returncode}: {self._log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.2)
        raise PeerError(f"{SERVER_BINARY} did not become healthy within {timeout:.0f}s: {self._log_tail()}")

    def complete(self, prompt_ids: Sequence[int], params: SamplingParams, timeout: float = 1800.0) -> PeerRun:
        body = {
            "prompt": [int(t) for t in prompt_ids], "n_predict": params.max_tokens, "cache_prompt": False,
            "return_tokens": True, "ignore_eos": params.ignore_eos, "stream": False,
        }
        if params.greedy:
            body.update(temperature=0.0, top_k=1)
        else:
            body.update(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p)
            if params.seed is not None:
                body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        request = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        began = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                answer = json.loads(response.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError) as exc:
            raise PeerError(f"{SERVER_BINARY} request failed: {exc}; {self._log_tail()}") from exc
        seconds = time.perf_counter() - began
        if "tokens" not in answer:
            raise PeerError(f"{SERVER_BINARY} returned no tokens: {str(answer)[:200]}")
        timings = answer.get("timings") or {}
        stats = SpecStats(num_prompt_tokens=len(prompt_ids))
        stats.num_generated_tokens = len(answer["tokens"])
        stats.num_draft_tokens = int(timings.get("draft_n") or 0)
        stats.num_accepted_tokens = int(timings.get("draft_n_accepted") or 0)
        stats.prefill_seconds = float(timings.get("prompt_ms") or 0.0) / 1000
        stats.total_seconds = seconds
        finish = "length" if answer.get("stop_type") == "limit" else "stop"
        settings = {"server_args": self.command[1:], "stop_type": answer.get("stop_type"), "timings": timings}
        return PeerRun(list(answer["tokens"]), seconds, finish, stats, settings)

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(10)
        self._log.close()


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
        for server in self._servers.values():
            server.close()
        self._servers.clear()


__all__ = ["LlamaServer", "PeerConfig", "PeerError", "PeerPool", "PeerRun", "binaries_dir", "missing_reason"]
