"""What the benches that run our server beside llama-server share: the systems that can run (and why the others
cannot), their servers started once, the rotated order of systems per item, and the summary's numbers."""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from specdec.bench.llamacpp_peer import binaries_dir, missing_reason, server_flags
from specdec.bench.serving.cli import our_model_args, target_gguf
from specdec.bench.serving.client import cpu_count
from specdec.bench.serving.run import (
    LLAMACPP_SYSTEMS,
    ServeOptions,
    ServerProcess,
    free_port,
    llama_command,
    our_command,
)
from specdec.config import ConfigError
from specdec.core.intervals import speedup_interval


def chosen(flag: str, text: str, allowed) -> list[str]:
    """A comma list flag's names, each one of `allowed`; ConfigError naming the flag otherwise."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise ConfigError(f"{flag}: unknown or no names {unknown}: choose from {', '.join(allowed)}")
    return names


def side_by_side_options(args, systems: Sequence[str], threads: int) -> tuple[ServeOptions, dict]:
    """The servers' shared options (our model flags, llama-server's GGUF and binaries) for the systems that can
    run here, and {system: why not} for the others."""
    gguf = target_gguf(args.model)
    bin_dir = binaries_dir(args.llamacpp_bin)
    runnable, skipped = runnable_systems(systems, bin_dir, gguf)
    options = ServeOptions(
        model_args=our_model_args(args), threads=threads or cpu_count(), max_context=args.max_context,
        max_tokens=0, concurrency=(1,), systems=runnable, target_gguf=gguf, llamacpp_bin=bin_dir,
        request_timeout=args.request_timeout, extra={"model": args.model})
    return options, skipped


def write_results(results: dict, out_dir: str | Path, markdown: str) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "results.md"}
    paths["json"].write_text(json.dumps(results, indent=1))
    paths["markdown"].write_text(markdown)
    return paths


def runnable_systems(systems: Sequence[str], bin_dir: Path | None, gguf: Path | None) -> tuple[tuple[str, ...], dict]:
    """The systems that can run here, and {system: why not} for the llama.cpp ones that cannot (said on stderr)."""
    skipped: dict[str, str] = {}
    if any(s in LLAMACPP_SYSTEMS for s in systems):
        why = missing_reason(bin_dir, gguf)
        if why:
            skipped = {s: why for s in systems if s in LLAMACPP_SYSTEMS}
            for system, reason in skipped.items():
                print(f"skipping {system}: {reason}", file=sys.stderr)
    return tuple(s for s in systems if s not in skipped), skipped


def start_servers(options: ServeOptions, systems: Sequence[str], say, jinja: bool = False) -> dict[str, ServerProcess]:
    """Every system's server, one slot each; jinja: llama-server renders the model's own chat template."""
    servers: dict[str, ServerProcess] = {}
    try:
        for system in systems:
            port = free_port()
            if system in LLAMACPP_SYSTEMS:
                command = llama_command(options, system, 1, port)
                if jinja and "--jinja" in server_flags(command[0]):
                    command.append("--jinja")
            else:
                command = our_command(options, system, 1, port, True)
            say(f"starting {system}: {' '.join(command[:2])} ...")
            servers[system] = ServerProcess(command, port, options.start_timeout)
    except BaseException:
        for server in servers.values():
            server.close()
        raise
    return servers


def rotated(systems: Sequence[str], index: int) -> list[str]:
    """The systems in the order item `index` takes them: rotated, so none is always first (or last)."""
    shift = index % len(systems)
    return [*systems[shift:], *systems[:shift]]


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def interval(ratios: list[float]) -> dict | None:
    """The geometric mean of positive paired ratios with its 95% t-interval (None with too few)."""
    found = speedup_interval([r for r in ratios if r and r > 0])
    return found.to_dict() if found else None


def number(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def ratio_text(found: dict | None) -> str:
    return "-" if not found else f"{found['estimate']:.2f}x [{found['low']:.2f}, {found['high']:.2f}]"
