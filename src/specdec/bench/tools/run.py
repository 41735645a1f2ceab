"""The tools bench's runs: every system's server started once, each BFCL problem sent to each in turn (systems
rotated per problem) with its functions as tools, then each simple problem's parameter schema as response_format;
verdicts after all timing."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Sequence

from specdec.bench.serving.run import ServeOptions, ServerProcess
from specdec.bench.side_by_side import rotated, start_servers
from specdec.bench.tools.client import ChatRecord, stream_chat
from specdec.bench.tools.problems import ToolProblem, json_schema, openai_tools
from specdec.bench.tools.scoring import answer_is_right

SYSTEMS = {
    "reference": "specdec serve --drafter none --exact: plain decoding, the identity reference",
    "ours": "specdec serve: the default drafter (suffix) and adaptive k",
    "llamacpp_plain": "llama-server --jinja",
    "llamacpp_ngram": "llama-server --jinja --spec-type ngram-simple",
}
DEFAULT_SYSTEMS = ("reference", "ours", "llamacpp_plain")
MAX_TOKENS = {"tools": 256, "structured": 256}


def tool_body(problem: ToolProblem) -> dict:
    return {"messages": problem.messages, "tools": openai_tools(problem), "tool_choice": "auto", "temperature": 0,
            "max_tokens": MAX_TOKENS["tools"]}


def structured_schema(problem: ToolProblem) -> dict:
    return json_schema(problem.functions[0].get("parameters") or {"type": "object"})


def structured_body(problem: ToolProblem) -> dict:
    """The problem's question, answered as the first function's arguments, constrained to its parameter schema."""
    function = problem.functions[0]
    question = problem.messages[-1]["content"]
    ask = (f"{question}\n\nReply with only the JSON object of the arguments for a call to the function "
           f"{function['name']} ({function.get('description', '')}).")
    return {"messages": [*problem.messages[:-1], {"role": "user", "content": ask}], "temperature": 0,
            "max_tokens": MAX_TOKENS["structured"],
            "response_format": {"type": "json_schema", "json_schema": {"name": "arguments", "strict": True,
                                                                      "schema": structured_schema(problem)}}}


async def run_requests(servers: dict[str, ServerProcess], problems: Sequence[ToolProblem], structured: Sequence[ToolProblem],
                       timeout: float, say) -> list[ChatRecord]:
    import httpx  # the bench extra (cli.py checked it is installed)

    plan = [("tools", p, tool_body(p)) for p in problems] + [("structured", p, structured_body(p)) for p in structured]
    records: list[ChatRecord] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0)) as client:
        warm = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
        for system, server in servers.items():  # untimed: first-use costs (calibration, grammar tokenizer) paid
            for body in (warm, tool_body(problems[0]) if problems else warm,
                         structured_body(structured[0]) if structured else warm):
                record = await stream_chat(client, server.url, body, ChatRecord(system, "warmup", "warmup"), timeout)
                if record.error:
                    raise RuntimeError(f"{system}: the warm-up request failed: {record.error}; {server.log_tail()}")
        for index, (kind, problem, body) in enumerate(plan):
            for system in rotated(list(servers), index):
                records.append(await stream_chat(client, servers[system].url, body,
                                                 ChatRecord(system, problem.id, kind), timeout))
            if (index + 1) % 10 == 0:
                say(f"  {index + 1}/{len(plan)} requests per system")
    return records


def judge(records: Sequence[ChatRecord], problems: Sequence[ToolProblem], structured: Sequence[ToolProblem]) -> list[dict]:
    """Each record with its verdict: BFCL's for a tool answer, schema validity (jsonschema) for a structured one."""
    import jsonschema  # the bench extra

    tools_by_id = {p.id: p for p in problems}
    structured_by_id = {p.id: p for p in structured}
    out = []
    for record in records:
        row = record.to_dict()
        if record.error is None and record.kind == "tools":
            problem = tools_by_id[record.item]
            row["set"] = problem.set
            calls = record.parsed_calls()
            row["right"] = calls is not None and answer_is_right(calls, problem.ground_truth)
        elif record.error is None and record.kind == "structured":
            problem = structured_by_id[record.item]
            row["set"] = "structured"
            try:
                jsonschema.validate(json.loads(record.content), structured_schema(problem))
                row["valid"] = True
            except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError):
                row["valid"] = False
        out.append(row)
    return out


def run_tools_bench(problems: Sequence[ToolProblem], structured: Sequence[ToolProblem], options: ServeOptions,
                    log: Callable[[str], None] | None = None) -> dict:
    say = log or (lambda message: print(message, file=sys.stderr, flush=True))
    began = time.perf_counter()
    servers = start_servers(options, options.systems, say, jinja=True)
    try:
        say(f"{len(problems)} tool problems + {len(structured)} structured-output problems x {len(servers)} systems")
        records = asyncio.run(run_requests(servers, problems, structured, options.request_timeout, say))
        commands = {name: server.command for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.close()
    return {"records": judge(records, problems, structured), "commands": commands,
            "problems": [p.id for p in problems], "structured_problems": [p.id for p in structured],
            "wall_seconds": round(time.perf_counter() - began, 1)}
