"""The FIM bench's runs: every system's server started once, the sampled problems sent to each in turn (the order of
systems rotated per problem), an editor trace after, then the unit tests (never while anything is timed)."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psutil

from specdec.bench.fim.client import InfillRecord, infill_body, stream_infill
from specdec.bench.fim.problems import FimProblem
from specdec.bench.fim.scoring import exact_match, passes
from specdec.bench.serving.run import ServeOptions, ServerProcess, free_port, our_command
from specdec.bench.side_by_side import rotated, start_servers

SYSTEMS = {
    "reference": "specdec serve --drafter none --exact: plain decoding, the identity reference",
    "ours": "specdec serve: the default drafter (suffix) and adaptive k",
    "ours_exact": "specdec serve --exact: batch-invariant kernels (must equal the reference bit for bit)",
    "llamacpp_plain": "llama-server",
    "llamacpp_ngram": "llama-server --spec-type ngram-simple",
}
DEFAULT_SYSTEMS = tuple(SYSTEMS)
TOKENS = {"single": 48, "multi": 128}  # n_predict per set: a line, a block (HumanEval's gaps fit)
WARMUP = ("def greet(name):\n    ", "\n    return message\n")
COLD = "ours_cold"  # the trace's cold lane: the default server, every request with a fresh cache_salt


@dataclass
class TraceOptions:
    """The editor trace: files typed into at successive cursor positions, every `cancel_every`-th request
    cancelled `cancel_after` seconds after it was sent (the next keystroke)."""

    files: int = 4
    steps: int = 6
    stride: int = 12  # characters typed between two requests
    n_predict: int = 32
    cancel_every: int = 3
    cancel_after: float = 0.3


async def _send(client, url: str, system: str, item: str, body: dict, timeout: float,
                cancel_after: float | None = None) -> InfillRecord:
    return await stream_infill(client, url, body, InfillRecord(system, item), timeout, cancel_after)


async def run_problems(servers: dict[str, ServerProcess], problems: Sequence[FimProblem], timeout: float,
                       say) -> list[InfillRecord]:
    """Each problem to every system in turn, one request at a time; an untimed warm-up per server first."""
    import httpx  # the bench extra (bench/fim/cli.py checked it is installed)

    records: list[InfillRecord] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0)) as client:
        for system, server in servers.items():
            warm = await _send(client, server.url, system, "warmup", infill_body(*WARMUP, 8), timeout)
            if warm.error:
                raise RuntimeError(f"{system}: the warm-up request failed: {warm.error}; {server.log_tail()}")
        for index, problem in enumerate(problems):
            for system in rotated(list(servers), index):
                body = infill_body(problem.prefix, problem.suffix, TOKENS[problem.set])
                records.append(await _send(client, servers[system].url, system, problem.task_id, body, timeout))
            if (index + 1) % 5 == 0:
                say(f"  {index + 1}/{len(problems)} problems")
    return records


def trace_requests(problems: Sequence[FimProblem], options: TraceOptions) -> list[tuple[str, str, str, bool]]:
    """(item, prefix, suffix, cancelled) per request: in each file the gap's code typed `stride` characters at a
    time, a completion asked after each burst, every `cancel_every`-th one cancelled."""
    out = []
    for problem in problems[:options.files]:
        for step in range(options.steps):
            typed = problem.solution[:step * options.stride]
            number = len(out) + 1
            out.append((f"{problem.task_id}@{len(typed)}", problem.prefix + typed, problem.suffix,
                        number % options.cancel_every == 0))
    return out


def _rss(server: ServerProcess) -> int | None:
    try:
        return psutil.Process(server.pid).memory_info().rss
    except (psutil.Error, OSError):
        return None


async def run_trace(servers: dict[str, ServerProcess], problems: Sequence[FimProblem], options: TraceOptions,
                    timeout: float) -> dict:
    """The trace on ours (prefix cells and caches kept), on ours sent cold (a fresh cache_salt per request:
    nothing any earlier request left is used) and on llama-server (cache_prompt), request by request in turn;
    our server's memory and running requests before and after."""
    import httpx  # the bench extra (bench/fim/cli.py checked it is installed)

    systems = [s for s in ("ours", "llamacpp_plain", "llamacpp_ngram") if s in servers]
    plan = trace_requests(problems, options)
    records: list[InfillRecord] = []
    before = {s: _rss(servers[s]) for s in systems}
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0)) as client:
        for index, (item, prefix, suffix, cancel) in enumerate(plan):
            lanes = [(s, s, None) for s in systems]
            if COLD in servers:  # a server of its own: a cold request must not evict the warm one's slot
                lanes.append((COLD, COLD, uuid.uuid4().hex))
            for label, system, salt in rotated(lanes, index):
                body = infill_body(prefix, suffix, options.n_predict, {"cache_salt": salt} if salt else None)
                records.append(await _send(client, servers[system].url, label, item, body, timeout,
                                           options.cancel_after if cancel else None))
        await asyncio.sleep(1.0)  # a cancelled request leaves at the engine's next step
        after_running = None
        if "ours" in servers:
            metrics = (await client.get(servers["ours"].url + "/metrics")).text
            after_running = sum(float(line.split()[-1]) for line in metrics.splitlines()
                                if line.startswith("specdec:num_requests_running"))
    after = {s: _rss(servers[s]) for s in systems}
    return {"options": options.__dict__, "records": [r.to_dict() for r in records], "rss_before": before,
            "rss_after": after, "ours_running_after": after_running}


def score(records: Sequence[InfillRecord], problems: Sequence[FimProblem], say) -> list[dict]:
    """Every completed record with its unit-test verdict and exact match (run after all timing)."""
    by_id = {p.task_id: p for p in problems}
    out = []
    for number, record in enumerate(records, 1):
        row = record.to_dict()
        problem = by_id.get(record.item)
        if problem is not None and record.error is None:
            row["passed"], row["exact_match"] = passes(problem, record.content), exact_match(problem, record.content)
            row["set"] = problem.set
        if number % 25 == 0:
            say(f"  scored {number}/{len(records)}")
        out.append(row)
    return out


def run_fim_bench(problems: Sequence[FimProblem], options: ServeOptions, trace: TraceOptions | None,
                  log: Callable[[str], None] | None = None) -> dict:
    say = log or (lambda message: print(message, file=sys.stderr, flush=True))
    began = time.perf_counter()
    servers = start_servers(options, options.systems, say)
    try:
        say(f"{len(problems)} problems x {len(servers)} systems")
        records = asyncio.run(run_problems(servers, problems, options.request_timeout, say))
        trace_result = None
        if trace is not None:
            if "ours" in servers:
                port = free_port()
                say(f"starting {COLD} (the trace's cold lane)")
                servers[COLD] = ServerProcess(our_command(options, "ours", 1, port, True), port,
                                              options.start_timeout)
            say("editor trace")
            trace_result = asyncio.run(run_trace(servers, problems, trace, options.request_timeout))
        commands = {name: server.command for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.close()
    say("running the unit tests")
    return {"records": score(records, problems, say), "trace": trace_result, "commands": commands,
            "problems": [p.task_id for p in problems], "wall_seconds": round(time.perf_counter() - began, 1)}
