"""Issue 18's measurements of `specdec serve --replicas` (Ray Serve) on one machine; run.sh calls this.

throughput: each system started on its own (a fresh server, then stopped), warmed up with one request, then
    the prompts sent as streaming greedy chat requests at --concurrency in flight (the serving bench's closed
    loop, bench/serving_client.py). Systems:
      ray2x1  specdec serve --replicas 2 --threads 1 --replica-cpus 1
      ray1x1  specdec serve --replicas 1 --threads 1 --replica-cpus 1
      serve2  specdec serve --threads 2             (one process, one request at a time)
      serve1  specdec serve --threads 1             (not in the default list: the Ray path's own cost vs ray1x1)
      serve2p specdec serve --threads 2 --parallel C (one process, C requests batched together)
    Aggregate tok/s = completion tokens of all requests / wall time of the level.

kill: one `specdec serve --replicas 2 --threads 1 --exact` (greedy output is then bit-identical whatever else
    runs, so any difference from the reference pass is corruption). A reference pass first (no kill), then the
    same requests at --concurrency in flight, and once the victim replica has two requests (one generating,
    one queued) it is killed with SIGKILL. Every request is classified:
      ok         complete ([DONE], a finish reason) and identical to its reference text;
      retried    ok, after its first replica failed before sending anything (x-specdec-attempts > 1);
      error      ended with a clear error event (code replica_failed), then [DONE];
      corrupted  complete but different from the reference;
      lost       anything else: no [DONE], a connection error, an HTTP error, a time-out.
    The replacement replica is waited for and one more request is sent through it.

Everything goes to --out: results.json (all records), results.md (the tables).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

from specdec.bench.datasets import select_prompts
from specdec.bench.serving import ServerProcess, free_port, lscpu
from specdec.bench.serving_client import RequestRecord, apply_event, chat_body, parse_event, run_level, warm_up
from specdec.bench.serving_report import percentile

SYSTEMS = {
    "ray2x1": ["--replicas", "2", "--threads", "1", "--replica-cpus", "1"],
    "ray1x1": ["--replicas", "1", "--threads", "1", "--replica-cpus", "1"],
    "serve2": ["--threads", "2"],
    "serve1": ["--threads", "1"],
    "serve2p": ["--threads", "2", "--parallel", "{c}"],
}


def serve_command(model_args: list[str], flags: list[str], port: int, concurrency: int) -> list[str]:
    return [sys.executable, "-m", "specdec.cli", "serve", *model_args, *(f.format(c=concurrency) for f in flags),
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]


class Server(ServerProcess):
    """ServerProcess, and on close every process left in its session (a local Ray instance's raylet and
    workers are the command's children)."""

    def close(self) -> None:
        pid = self.process.pid
        try:
            super().close()
        finally:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def replicas(url: str) -> list[dict]:
    with urllib.request.urlopen(url + "/replicas", timeout=10) as response:
        return json.load(response)["replicas"]


# --------------------------------------------------------------------------------------------- throughput


def throughput(args, prompts) -> dict:
    levels = []
    for system in args.systems.split(","):
        port = free_port()
        command = serve_command(args.model_args, SYSTEMS[system], port, args.concurrency)
        print(f"{system}: {' '.join(command)}", file=sys.stderr, flush=True)
        level = {"system": system, "command": command, "concurrency": args.concurrency}
        began = time.perf_counter()
        try:
            server = Server(command, port, args.start_timeout)
        except Exception as exc:  # noqa: BLE001 - reported, the others still run
            level.update(status="failed_to_start", error=str(exc)[:500])
            levels.append(level)
            continue
        try:
            level["start_seconds"] = round(time.perf_counter() - began, 1)
            warm = warm_up(server.url, 16, args.request_timeout)
            if not warm.ok:
                level.update(status="warmup_failed", error=warm.error)
                continue
            records, wall = run_level(server.url, prompts, args.concurrency, args.max_tokens,
                                      timeout=args.request_timeout)
            good = [r for r in records if r.ok]
            tokens = sum(r.completion_tokens or 0 for r in good)
            level.update(status="ok", wall_seconds=round(wall, 2), completion_tokens=tokens,
                         failures=len(records) - len(good), tok_per_s=round(tokens / wall, 2),
                         ttft_p50=percentile([r.ttft for r in good], 50),
                         e2e_p50=percentile([r.e2e for r in good], 50),
                         records=[r.to_dict() for r in records])
            if system.startswith("ray"):
                level["replicas"] = replicas(server.url)
            print(f"  {level['tok_per_s']} tok/s, {level['failures']} failed", file=sys.stderr, flush=True)
        finally:
            server.close()
            levels.append(level)
    return {"levels": levels}


def throughput_table(result: dict) -> str:
    rows = {lv["system"]: lv for lv in result["levels"]}
    base = rows.get("ray1x1", {}).get("tok_per_s")
    lines = ["| system | command flags | aggregate tok/s | vs 1 replica | TTFT p50 s | e2e p50 s | failed |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for system, lv in rows.items():
        flags = " ".join(SYSTEMS[system]).format(c=lv["concurrency"])
        if lv.get("status") != "ok":
            lines.append(f"| {system} | `{flags}` | {lv.get('status')}: {lv.get('error', '')[:80]} | | | | |")
            continue
        vs = f"{lv['tok_per_s'] / base:.2f}x" if base else "-"
        lines.append(f"| {system} | `{flags}` | {lv['tok_per_s']:.2f} | {vs} | {lv['ttft_p50']:.2f} | "
                     f"{lv['e2e_p50']:.2f} | {lv['failures']} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- kill -9


async def stream(client, url: str, prompt, max_tokens: int, timeout: float) -> dict:
    record = RequestRecord(prompt.task, prompt.id, 0)
    began = time.perf_counter()
    out = {"id": f"{prompt.task}/{prompt.id}", "replica": None, "attempts": None, "error_code": None, "done": False}

    async def read():
        async with client.stream("POST", url + "/v1/chat/completions", json=chat_body(prompt.text, max_tokens)) as r:
            record.status = r.status_code
            out["replica"], out["attempts"] = r.headers.get("x-specdec-replica"), r.headers.get("x-specdec-attempts")
            if r.status_code != 200:
                record.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return
            async for line in r.aiter_lines():
                payload = parse_event(line)
                if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
                    out["error_code"] = payload["error"].get("code")
                if payload == "[DONE]":
                    out["done"] = True
                if apply_event(record, payload, began, time.perf_counter()):
                    if payload != "[DONE]":  # an error event: read on to its [DONE]
                        continue
                    return

    try:
        await asyncio.wait_for(read(), timeout)
    except Exception as exc:  # noqa: BLE001
        record.error = record.error or f"{type(exc).__name__}: {str(exc)[:200]}"
    out.update(text=record.text, finish_reason=record.finish_reason, error=record.error,
               e2e=round(time.perf_counter() - began, 3))
    return out


async def kill_run(url: str, prompts, concurrency: int, max_tokens: int, timeout: float, kill: bool) -> dict:
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    results: list[dict] = []
    killed: dict = {}

    async def worker():
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30)) as client:
            while not queue.empty():
                results.append(await stream(client, url, queue.get_nowait(), max_tokens, timeout))

    async def killer():
        loop = asyncio.get_running_loop()
        while not all(task.done() for task in workers):
            rows = await loop.run_in_executor(None, replicas, url)
            busy = [r for r in rows if r.get("running", 0) >= 1 and r.get("waiting", 0) >= 1]
            if busy:
                victim = busy[0]
                os.kill(victim["pid"], signal.SIGKILL)
                killed.update(replica=victim["replica"], pid=victim["pid"], at=time.time(),
                              running=victim["running"], waiting=victim["waiting"])
                return
            await asyncio.sleep(0.25)

    workers = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
    await asyncio.gather(*workers, *([killer()] if kill else []))
    return {"records": results, "killed": killed}


def classify(record: dict, reference: dict[str, str]) -> str:
    if record["error_code"] == "replica_failed" and record["done"]:
        return "error"
    if record["error"] is None and record["done"] and record["finish_reason"]:
        if record["text"] != reference.get(record["id"]):
            return "corrupted"
        return "retried" if record["attempts"] not in (None, "1") else "ok"
    return "lost"


def kill_test(args, prompts) -> dict:
    port = free_port()
    command = serve_command(args.model_args, ["--replicas", "2", "--threads", "1", "--replica-cpus", "1", "--exact"],
                            port, args.concurrency)
    print(f"kill: {' '.join(command)}", file=sys.stderr, flush=True)
    server = Server(command, port, args.start_timeout)
    try:
        warm_up(server.url, 16, args.request_timeout)
        before = replicas(server.url)
        reference_run = asyncio.run(kill_run(server.url, prompts, args.concurrency, args.max_tokens,
                                             args.request_timeout, kill=False))
        reference = {r["id"]: r["text"] for r in reference_run["records"] if r["error"] is None}
        run = asyncio.run(kill_run(server.url, prompts, args.concurrency, args.max_tokens, args.request_timeout,
                                   kill=True))
        counts: dict[str, int] = {}
        for record in run["records"]:
            record["outcome"] = classify(record, reference)
            counts[record["outcome"]] = counts.get(record["outcome"], 0) + 1
        deadline, after = time.monotonic() + 180, []
        while time.monotonic() < deadline:  # Ray Serve's replacement replica
            after = replicas(server.url)
            if len(after) == 2 and run["killed"].get("replica") not in {r["replica"] for r in after}:
                break
            time.sleep(1)
        replaced_in = None
        if run["killed"]:
            replaced_in = round(time.time() - run["killed"]["at"], 1) if len(after) == 2 else None
        followup = asyncio.run(kill_run(server.url, prompts[:2], 2, args.max_tokens, args.request_timeout, kill=False))
        return {"command": command, "replicas_before": before, "replicas_after": after, "killed": run["killed"],
                "replacement_seen_after_seconds": replaced_in, "counts": counts, "records": run["records"],
                "reference_failures": [r for r in reference_run["records"] if r["error"] is not None],
                "followup": [classify(r, reference) for r in followup["records"]]}
    finally:
        server.close()


def kill_table(result: dict) -> str:
    counts = result["counts"]
    lines = ["| outcome | requests |", "|---|---:|"]
    for outcome in ("ok", "retried", "error", "corrupted", "lost"):
        lines.append(f"| {outcome} | {counts.get(outcome, 0)} |")
    killed = result["killed"]
    lines.append("")
    lines.append(f"Killed replica {killed.get('replica')} (pid {killed.get('pid')}) while it had "
                 f"{killed.get('running')} running and {killed.get('waiting')} waiting; replacement seen after "
                 f"{result['replacement_seen_after_seconds']} s; requests after it: {result['followup']}.")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("throughput", "kill", "both"))
    parser.add_argument("--model-args", default="default", help="the model flags every server gets (default: default)")
    parser.add_argument("--systems", default="ray2x1,ray1x1,serve2,serve2p")
    parser.add_argument("--tasks", default="spec_bench,humaneval,code_edit")
    parser.add_argument("--limit", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--out", default=str(Path(__file__).parent))
    args = parser.parse_args()
    args.model_args = args.model_args.split()
    prompts = select_prompts(args.tasks, None, args.limit)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"argv": sys.argv[1:], "prompts": [f"{p.task}/{p.id}" for p in prompts], "lscpu": lscpu(),
               "concurrency": args.concurrency, "max_tokens": args.max_tokens}
    try:
        import ray

        results["ray"] = ray.__version__
    except ImportError:
        results["ray"] = None
    markdown = []
    if args.mode in ("throughput", "both"):
        results["throughput"] = throughput(args, prompts)
        markdown += [f"## Throughput at concurrency {args.concurrency} ({len(prompts)} chat prompts, greedy, "
                     f"{args.max_tokens} tokens)", "", throughput_table(results["throughput"]), ""]
    if args.mode in ("kill", "both"):
        results["kill"] = kill_test(args, prompts)
        markdown += [f"## kill -9 of one replica under {args.concurrency} concurrent streams", "",
                     kill_table(results["kill"]), ""]
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text("\n".join(markdown))
    print("\n".join(markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
