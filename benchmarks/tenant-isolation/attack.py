"""Attack bench for tenant isolation (issue 44): cache oracles across and within tenants, greedy identity across
tenants, oversized-but-valid bodies, and the cost of stream pacing, against `specdec serve` on loopback.

Every loop is bounded (--trials); every server is started here, on 127.0.0.1, and stopped at the end. It speaks
HTTP only. Output: a JSON record (--out) and a summary on stdout; benchmarks/tenant-isolation/README.md has the
tables of a run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from specdec.core.intervals import binomial_interval, speedup_interval

KEYS = {"alice": "alice-key-0123456789", "mallory": "mallory-key-0123456789"}
WORDS = ("amber", "birch", "cobalt", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kestrel",
         "lumen", "maple", "nectar", "onyx", "pepper", "quartz", "raven", "saffron", "tundra", "umber", "velvet")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`specdec serve` in a subprocess on a free loopback port; requests by tenant name (None: no key)."""

    def __init__(self, name: str, out: Path, args: list[str], keys_file: Path | None, pythonpath: str | None = None):
        self.name, self.port = name, free_port()
        cmd = [sys.executable, "-c", "from specdec.cli.main import entry; entry()", "serve", *args,
               "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"]
        if keys_file is not None:
            cmd += ["--api-keys", str(keys_file)]
        env = dict(os.environ)
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        self.log = open(out / f"server-{name}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=600)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server {name} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"server {name} did not become ready")

    def post(self, path: str, body: dict, tenant: str | None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {KEYS[tenant]}"} if tenant else {}
        return self.http.post(path, json=body, headers=headers)

    def ok(self, path: str, body: dict, tenant: str | None) -> dict:
        response = self.post(path, body, tenant)
        if response.status_code != 200:
            raise SystemExit(f"{self.name}: {path} answered {response.status_code}: {response.text[:300]}")
        return response.json()

    def memory_kb(self, field: str) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        return 0

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.http.close()
        self.log.close()


def chance_summary(hits: int, trials: int, chance: float) -> dict:
    low, high = binomial_interval(hits, trials)
    return {"hits": hits, "trials": trials, "accuracy": round(hits / trials, 4), "ci95": [round(low, 4), round(high, 4)],
            "chance": chance, "interval_contains_chance": low <= chance <= high}


# --------------------------------------------------------------------------------------------- the oracles


def pin_attack(server: Server, trials: int, victim: str, attacker: str, rng: random.Random) -> dict:
    """The victim's note holds a 4-digit PIN; before each guess the victim's note is sent again (a template it
    reuses), then the attacker sends the note's opening with one guessed first digit and reads the cache:
    the guess with the most cached prompt tokens wins, ties going to the fastest prefill."""
    hits = 0
    for _ in range(trials):
        name = f"{rng.choice(WORDS)} {rng.choice(WORDS)} {rng.randrange(10**6)}"
        pin = "".join(rng.choice("0123456789") for _ in range(4))
        opening = f"House notes for the sitter of {name}. Door PIN: "
        scores = []
        for digit in rng.sample("0123456789", 10):
            server.ok("/v1/completions", {"prompt": opening + pin + ". Feed the cat at six.", "max_tokens": 1,
                                          "temperature": 0}, victim)
            reply = server.ok("/v1/completions", {"prompt": opening + digit + " ?", "max_tokens": 1,
                                                  "temperature": 0}, attacker)
            cached = reply["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
            scores.append((-cached, reply["specdec"]["prefill_seconds"], digit))
        hits += min(scores)[2] == pin[0]
    return chance_summary(hits, trials, 0.1)


def suffix_probe(server: Server, trials: int, victim: str, attacker: str, rng: random.Random,
                 max_tokens: int) -> dict:
    """The victim asks one of ten fresh questions (the secret: which); the attacker asks all ten and picks the
    one whose answer came with the most accepted draft tokens (the suffix cache drafting the victim's answer),
    ties going to the fewest target passes, then the fastest."""
    hits = 0
    for _ in range(trials):
        shops = [f"{rng.choice(WORDS)} {rng.choice(WORDS)} {rng.randrange(10**6)}" for _ in range(10)]
        secret = rng.randrange(10)

        def ask(shop: str, tenant: str) -> dict:
            return server.ok("/v1/chat/completions", {"messages": [
                {"role": "user", "content": f"Write a two-line poem about a shop called {shop}."}],
                "max_tokens": max_tokens, "temperature": 0}, tenant)

        ask(shops[secret], victim)
        scores = []
        for index in rng.sample(range(10), 10):
            stats = ask(shops[index], attacker)["specdec"]
            scores.append((-stats["num_accepted_tokens"], stats["num_target_forwards"], stats["e2e_seconds"], index))
        hits += min(scores)[3] == secret
    return chance_summary(hits, trials, 0.1)


# --------------------------------------------------------------------------------------------- identity, speed


QUESTIONS = [f"Explain in three sentences how a {thing} works." for thing in
             ("bicycle gear", "heat pump", "hash table", "compiler")]
IDENTITY_TOKENS = 64


def greedy_texts(server: Server, tenant: str | None, max_tokens: int) -> list[str]:
    return [server.ok("/v1/chat/completions", {"messages": [{"role": "user", "content": q}], "max_tokens": max_tokens,
                                               "temperature": 0}, tenant)["choices"][0]["message"]["content"]
            for q in QUESTIONS]


def repeat_speedup(server: Server, tenant: str | None, rng: random.Random, count: int, max_tokens: int) -> dict:
    """The same fresh question twice in one tenant: the second answer's speedup over the first (e2e time and
    target passes), pooled as a geometric mean with its 95% interval."""
    time_ratios, pass_ratios = [], []
    for _ in range(count):
        body = {"messages": [{"role": "user", "content": f"Describe the town of {rng.choice(WORDS).title()}"
                                                          f"{rng.choice(WORDS)} {rng.randrange(10**6)} in a paragraph."}],
                "max_tokens": max_tokens, "temperature": 0}
        first, second = (server.ok("/v1/chat/completions", body, tenant)["specdec"] for _ in range(2))
        time_ratios.append(first["e2e_seconds"] / second["e2e_seconds"])
        pass_ratios.append(first["num_target_forwards"] / second["num_target_forwards"])
    t, p = speedup_interval(time_ratios), speedup_interval(pass_ratios)
    return {"pairs": count, "time_speedup": t.to_dict(), "pass_ratio": p.to_dict()}


def stream_timing(server: Server, body: dict) -> tuple[float, float, int]:
    """Seconds to the first text, seconds to the end, and text events of one streamed completion."""
    began = time.perf_counter()
    first, events = None, 0
    with server.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice.get("finish_reason") is None:
                events += 1
                if first is None and choice.get("text"):
                    first = time.perf_counter() - began
    return first or 0.0, time.perf_counter() - began, events


def pacing_cost(unpaced: Server, paced: Server, count: int, max_tokens: int) -> dict:
    """Interleaved ABBA: the same streamed greedy completions on a server without and with pacing."""
    rows = []
    for i in range(count):
        body = {"prompt": f"def parse_record_{i}(line):\n    \"\"\"Split a CSV line into fields.\"\"\"\n",
                "max_tokens": max_tokens, "temperature": 0}
        order = (unpaced, paced) if i % 2 == 0 else (paced, unpaced)
        got = {server.name: stream_timing(server, body) for server in order}
        rows.append(got)
    first = speedup_interval([r[paced.name][0] / r[unpaced.name][0] for r in rows])
    total = speedup_interval([r[paced.name][1] / r[unpaced.name][1] for r in rows])
    return {"pairs": count, "first_text_ratio_paced_over_unpaced": first.to_dict(),
            "end_to_end_ratio_paced_over_unpaced": total.to_dict(),
            "events_unpaced": sum(r[unpaced.name][2] for r in rows), "events_paced": sum(r[paced.name][2] for r in rows)}


# --------------------------------------------------------------------------------------------- bounds


def oversized(server: Server) -> dict:
    """The bodies of the issue: 240k one-character messages, a 3.9M-id prompt; time to the answer, /health
    latency meanwhile (polled every 20 ms), and the server's memory (peak and sampled) around it."""
    bodies = {"240k_messages": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 240_000}),
              "3.9M_ids": ("/v1/completions", {"prompt": [1] * 3_900_000})}
    out = {}
    for name, (path, body) in bodies.items():
        data = json.dumps(body, separators=(",", ":")).encode()  # compact: both fit the default 8 MiB
        health, rss = [], []
        stop = threading.Event()

        def poll():
            with httpx.Client(base_url=server.http.base_url, timeout=30) as client:
                while not stop.is_set():
                    began = time.perf_counter()
                    client.get("/health")
                    health.append(time.perf_counter() - began)
                    rss.append(server.memory_kb("VmRSS"))
                    time.sleep(0.02)

        base_rss, base_peak = server.memory_kb("VmRSS"), server.memory_kb("VmHWM")
        poller = threading.Thread(target=poll)
        poller.start()
        time.sleep(0.2)
        began = time.perf_counter()
        response = server.http.post(path, content=data, headers={
            "Authorization": f"Bearer {KEYS['mallory']}", "Content-Type": "application/json"})
        took = time.perf_counter() - began
        time.sleep(0.2)
        stop.set()
        poller.join()
        out[name] = {"body_mib": round(len(data) / 2**20, 2), "status": response.status_code,
                     "code": response.json().get("error", {}).get("code"), "seconds": round(took, 3),
                     "health_max_ms": round(1000 * max(health), 1), "health_polls": len(health),
                     "rss_rise_mb": round((max(rss) - base_rss) / 1024, 1),
                     "peak_rise_mb": round((server.memory_kb("VmHWM") - base_peak) / 1024, 1)}
    return out


# --------------------------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="target (default: specdec's default pair)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--trials", type=int, default=200, help="cross-tenant trials of the PIN attack (0: none)")
    parser.add_argument("--probe-trials", type=int, default=200, help="cross-tenant trials of the suffix probe (0: none)")
    parser.add_argument("--control-trials", type=int, default=20, help="within-tenant trials of each oracle")
    parser.add_argument("--probe-tokens", type=int, default=16, help="max_tokens of the suffix probe's answers")
    parser.add_argument("--pairs", type=int, default=8, help="pairs for the repeat speedup and the pacing cost")
    parser.add_argument("--before-src", default=None, help="a src/ folder of an older specdec for the bounds' "
                                                           "before figures")
    parser.add_argument("--seed", type=int, default=44)
    parser.add_argument("--out", default="bench-results/tenant-isolation")
    parser.add_argument("--only", nargs="*", default=None,
                        help="sections to run: oracles identity speedup bounds pacing (default all)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = set(args.only or ["oracles", "identity", "speedup", "bounds", "pacing"])
    keys_file = Path(tempfile.mkdtemp()) / "keys"
    keys_file.write_text("".join(f"{tenant} {hashlib.sha256(key.encode()).hexdigest()}\n"
                                 for tenant, key in KEYS.items()))
    base = ([args.model] if args.model else []) + ["--threads", str(args.threads), "--parallel", str(args.parallel)]
    rng = random.Random(args.seed)
    record: dict = {"args": vars(args), "lscpu": subprocess.run(["lscpu"], capture_output=True, text=True).stdout}

    def save():
        (out / "results.json").write_text(json.dumps(record, indent=1))

    def section(name: str, value) -> None:
        record[name] = value
        print(name, json.dumps(value), flush=True)
        save()

    def identity(texts: list[str], reference: list[str]) -> dict:
        return {"questions": len(texts), "identical": sum(a == b for a, b in zip(texts, reference)),
                "differing": [i for i, (a, b) in enumerate(zip(texts, reference)) if a != b]}

    # Greedy identity in fast mode: B's questions on a fresh server, and on another fresh one after A asked the
    # same questions (A's answers would feed B's drafts if the suffix cache were shared); nothing else before.
    alone = None
    keyed = Server("keyed", out, base, keys_file)
    try:
        if "identity" in sections:
            alone = greedy_texts(keyed, "mallory", IDENTITY_TOKENS)
            other = Server("keyed-after-a", out, base, keys_file)
            try:
                greedy_texts(other, "alice", IDENTITY_TOKENS)
                section("greedy_identity_across_tenants", identity(greedy_texts(other, "mallory", IDENTITY_TOKENS),
                                                                   alone))
            finally:
                other.close()
        if "oracles" in sections:
            for oracle, run in (("pin_prefix_cache", lambda v, a, n: pin_attack(keyed, n, v, a, rng)),
                                ("repeated_answer_suffix_cache",
                                 lambda v, a, n: suffix_probe(keyed, n, v, a, rng, args.probe_tokens))):
                # --trials 0 / --probe-trials 0 leave that oracle's cross-tenant trials out (its within-tenant
                # control still runs, when --control-trials > 0, on the server as the sections before left it)
                trials = args.trials if oracle.startswith("pin") else args.probe_trials
                if trials == 0 and args.control_trials == 0:
                    continue
                began = time.monotonic()
                result = {}
                if trials:
                    result["across_tenants"] = run("alice", "mallory", trials)
                if args.control_trials:
                    result["within_one_tenant"] = run("alice", "alice", args.control_trials)
                section(oracle, {**result, "seconds": round(time.monotonic() - began, 1)})
        if "bounds" in sections:
            section("oversized_bodies", oversized(keyed))
        if "speedup" in sections:
            section("repeat_speedup_within_tenant_keys", repeat_speedup(keyed, "alice", rng, args.pairs, 64))
    finally:
        keyed.close()
    if sections & {"identity", "speedup", "pacing"}:
        shared = Server("no-keys", out, base, None)
        try:
            if "identity" in sections and alone is not None:
                # The negative control: everything shared (no keys), A's questions first.
                greedy_texts(shared, None, IDENTITY_TOKENS)
                section("greedy_identity_shared_negative_control",
                        identity(greedy_texts(shared, None, IDENTITY_TOKENS), alone))
            if "speedup" in sections:
                section("repeat_speedup_no_keys", repeat_speedup(shared, None, rng, args.pairs, 64))
            if "pacing" in sections:
                paced = Server("paced-4", out, [*base, "--stream-tokens-per-event", "4"], None)
                try:
                    section("pacing_4_tokens", pacing_cost(shared, paced, args.pairs, 48))
                finally:
                    paced.close()
        finally:
            shared.close()
    if args.before_src and "bounds" in sections:
        before = Server("before", out, base, keys_file, pythonpath=args.before_src)
        try:
            section("oversized_bodies_before", oversized(before))
        finally:
            before.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
