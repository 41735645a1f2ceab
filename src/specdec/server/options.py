"""The `specdec serve` flags (one process or replicas on Ray Serve) and their checks, shared by the command, its
Ray runner and Ray's own `serve run` (app_builder); nothing here imports the server's web stack or Ray."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os

from specdec.cli.flags import add_model_arguments, add_spec_arguments, model_ref_from_args
from specdec.errors import ConfigError, ModelLoadError, UserError
from specdec.loading.models import DEFAULT_MODELS, backend_for
from specdec.server.limits import (
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_READ_TIMEOUT,
    DEFAULT_SHUTDOWN_GRACE,
    ServerLimits,
)
from specdec.server.tenants import TenantKeys

# Slots when --parallel is not given and the target runs on llama.cpp: llama-server's automatic count (-np -1).
# Measured on the 2-vCPU AVX-512 EPYC, one client, 30 chat and code prompts (benchmarks/epyc-2core): 4 slots ran
# as fast as 1 (19.2 vs 17.6 tok/s in the same run) for 287 MiB more memory (KV room for four).
AUTO_PARALLEL = 4


def resolved_parallel(args: argparse.Namespace) -> int:
    """--parallel as given, else AUTO_PARALLEL where the target would load on llama.cpp, else 1 (a torch target:
    its static GPU decoder runs each sequence's forward on its own, so slots there interleave rather than batch).
    Sets args.parallel to the result, so every later reader sees one number."""
    if args.parallel is None:
        try:
            ref = model_ref_from_args(args)
            backend = backend_for(ref.target, ref.backend, ref.device)
        except (ConfigError, ModelLoadError, OSError, ValueError):
            backend = None  # the load says what is wrong with the model; one slot until then
        args.parallel = AUTO_PARALLEL if backend == "llama.cpp" else 1
    return args.parallel


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """Every `specdec serve` flag, the Ray Serve group included."""
    add_model_arguments(serve)
    add_spec_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY") or None,
                       help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECDEC_API_KEY, else no "
                       "authentication)")
    serve.add_argument("--api-keys", default=None, metavar="FILE",
                       help="require a key from FILE on /v1/*: one 'TENANT SHA256HEX' per line (the digest of the "
                       "key: printf %%s KEY | sha256sum; re-read on SIGHUP). Each tenant's requests share caches "
                       "only with that tenant's (docs/server.md); a request's cache_salt narrows that further")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="model name(s) clients send in 'model' (default: the target model argument)")
    serve.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                       help="log level of the server and uvicorn (default info)")
    serve.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
                       help=f"largest request body accepted; larger is 413 (default {DEFAULT_MAX_REQUEST_BYTES}, "
                       "8 MiB)")
    serve.add_argument("--parallel", "-np", type=int, default=None, metavar="N",
                       help="requests generated together, each with room for --max-context tokens (continuous "
                            "batching; llama-server's -np, vLLM's --max-num-seqs); more wait in the queue. Default: "
                            f"{AUTO_PARALLEL} on llama.cpp (llama-server's automatic slot count), 1 on torch, whose "
                            "static GPU decoder runs one sequence per forward; --parallel 1 serves one at a time")
    serve.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, metavar="N",
                       help=f"requests allowed to wait for the engine; more is 429 with Retry-After "
                       f"(default {DEFAULT_MAX_QUEUE})")
    serve.add_argument("--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT, metavar="SECONDS",
                       help="time a client has to send a request's headers, and then its body; else 408 and the "
                       f"connection is closed (default {DEFAULT_READ_TIMEOUT:g})")
    serve.add_argument("--shutdown-grace", type=float, default=DEFAULT_SHUTDOWN_GRACE, metavar="SECONDS",
                       help="on SIGTERM/SIGINT, time the running request gets to finish before it is ended with an "
                       f"error event (default {DEFAULT_SHUTDOWN_GRACE:g})")
    serve.add_argument("--stream-tokens-per-event", type=int, default=None, metavar="N",
                       help="send streamed text N tokens to an event (the last one fewer), whatever the drafts "
                       "accepted, so the event pattern does not show speculation's accepted lengths to someone "
                       "watching the network; costs up to N-1 tokens of delay per event (docs/server.md). "
                       "Default: each step's tokens as soon as they are accepted")
    serve.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                       help="Host header names accepted (any port), checked against DNS rebinding. Default: "
                       "localhost, 127.0.0.1 and [::1] when bound to loopback without --api-key, else no check; "
                       "'*' turns the check off")

    add_ray_arguments(serve)


def serve_parser() -> argparse.ArgumentParser:
    """A parser of `specdec serve` arguments alone (for Ray's `serve run`, which hands us flags as a mapping)."""
    parser = argparse.ArgumentParser(prog="specdec serve")
    add_serve_arguments(parser)
    return parser


def served_names(args: argparse.Namespace) -> list[str]:
    """The names clients may send in `model`: --served-model-name, else the target's."""
    if args.served_model_name:
        return list(args.served_model_name)
    if args.model == "default":
        return [DEFAULT_MODELS["default-target"].label]
    return [args.model]


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    """The request limits --max-request-bytes, --max-queue, --read-timeout, --parallel and
    --stream-tokens-per-event give, checked."""
    for flag, value in (("--max-request-bytes", args.max_request_bytes), ("--max-queue", args.max_queue),
                        ("--parallel", 1 if args.parallel is None else args.parallel),
                        ("--stream-tokens-per-event", 1 if args.stream_tokens_per_event is None
                         else args.stream_tokens_per_event)):
        if value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    if not 0 < args.read_timeout < math.inf:
        raise UserError(f"--read-timeout must be positive, got {args.read_timeout:g}")
    # The cheap checks above come first; an unset --parallel then asks where the target would run.
    return ServerLimits(args.max_request_bytes, args.max_queue, args.read_timeout, resolved_parallel(args),
                        stream_tokens_per_event=args.stream_tokens_per_event)


@dataclasses.dataclass(frozen=True)
class Scaling:
    """How many engine replicas and what each reserves."""

    replicas: int | None = 1  # fixed count; with autoscaling, the initial count
    min_replicas: int | None = None  # autoscaling when min or max is given
    max_replicas: int | None = None
    target_ongoing_requests: float = 1.0
    max_ongoing_requests: int = 2
    replica_cpus: float = 1.0

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None


RAY_FLAGS = ("replicas", "min_replicas", "max_replicas")


def add_ray_arguments(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group(
        "replicas on Ray Serve (pip install 'specdec[ray]'; docs/scale.md)",
        "Any of --replicas, --min-replicas, --max-replicas serves the same API from N engine replicas behind "
        "Ray Serve's HTTP proxy on --host/--port, each replica with its own model pair, --threads, --parallel "
        "slots and queue; a conversation is kept on the replica that has its prefix cached")
    group.add_argument("--replicas", type=int, default=None, metavar="N",
                       help="engine replicas (with --min/--max-replicas: how many to start with)")
    group.add_argument("--min-replicas", type=int, default=None, metavar="N",
                       help="autoscale: fewest replicas (default 1 when --max-replicas is given)")
    group.add_argument("--max-replicas", type=int, default=None, metavar="N",
                       help="autoscale: most replicas (default: --replicas, else --min-replicas)")
    group.add_argument("--target-ongoing-requests", type=float, default=None, metavar="X",
                       help="autoscale: requests in flight per replica that Ray Serve scales to (default: --parallel)")
    group.add_argument("--max-ongoing-requests", type=int, default=None, metavar="N",
                       help="requests a replica is given at once, generating or queued in it (default --parallel + 1); "
                       "more wait in the router, which then may send a conversation to its second-choice replica")
    group.add_argument("--replica-cpus", type=float, default=None, metavar="CPUS",
                       help="CPUs Ray reserves for each replica (default: --threads, else 1; --threads then "
                       "defaults to this, rounded down)")
    group.add_argument("--ray-address", default=None, metavar="ADDRESS",
                       help="join this Ray cluster (e.g. auto, or HEAD_IP:6379 after `ray start --head`); default: "
                       "start a local Ray instance for this command")


RAY_ONLY_FLAGS = ("target_ongoing_requests", "max_ongoing_requests", "replica_cpus", "ray_address")


def ray_requested(args: argparse.Namespace) -> bool:
    """Whether to serve on Ray Serve; a Ray-only flag without any replica count is refused."""
    if any(getattr(args, name, None) is not None for name in RAY_FLAGS):
        return True
    stray = [name for name in RAY_ONLY_FLAGS if getattr(args, name, None) is not None]
    if stray:
        raise UserError(f"--{stray[0].replace('_', '-')} applies to replicas on Ray Serve: add --replicas N "
                        "(or --min-replicas/--max-replicas)")
    return False


def scaling_from_args(args: argparse.Namespace) -> Scaling:
    """The replicas' count, autoscaling bounds and reservations, checked; fills in --threads (per replica)."""
    for flag in ("replicas", "min_replicas", "max_replicas", "max_ongoing_requests"):
        value = getattr(args, flag, None)
        if value is not None and value < (0 if flag == "min_replicas" else 1):
            raise UserError(f"--{flag.replace('_', '-')} must be at least {0 if flag == 'min_replicas' else 1}, "
                            f"got {value}")
    low, high = args.min_replicas, args.max_replicas
    if low is not None and high is not None and low > high:
        raise UserError(f"--min-replicas ({low}) is more than --max-replicas ({high})")
    if high is not None and args.replicas is not None and args.replicas > high:
        raise UserError(f"--replicas ({args.replicas}) is more than --max-replicas ({high})")
    if low is not None and args.replicas is not None and args.replicas < low:
        raise UserError(f"--replicas ({args.replicas}) is less than --min-replicas ({low})")
    if (low is not None or high is not None) and max(low or 0, high or 0, args.replicas or 0) < 1:
        raise UserError("autoscaling needs --max-replicas (or --replicas) of at least 1")

    parallel = resolved_parallel(args)
    target = args.target_ongoing_requests if args.target_ongoing_requests is not None else float(parallel)
    if not 0 < target < math.inf:
        raise UserError(f"--target-ongoing-requests must be positive, got {target:g}")
    most = args.max_ongoing_requests if args.max_ongoing_requests is not None else parallel + 1
    if most < target:
        raise UserError(f"--max-ongoing-requests ({most}) is less than --target-ongoing-requests ({target:g})")
    cpus = args.replica_cpus
    if cpus is None:
        cpus = float(args.threads) if args.threads else 1.0
    if not 0 <= cpus < math.inf:
        raise UserError(f"--replica-cpus must be at least 0, got {cpus:g}")
    if args.threads is None:
        args.threads = max(1, int(cpus))
    replicas = args.replicas if args.replicas is not None else (low if low else 1)
    return Scaling(replicas=replicas, min_replicas=low, max_replicas=high, target_ongoing_requests=target,
                   max_ongoing_requests=most, replica_cpus=cpus)


def tenants_from_args(args: argparse.Namespace) -> TenantKeys | None:
    """The key table --api-key (one tenant) or --api-keys FILE gives; None: no key required."""
    if args.api_key and args.api_keys:
        raise UserError("give --api-key or --api-keys, not both")
    if args.api_keys:
        return TenantKeys.from_file(args.api_keys)
    return TenantKeys.single(args.api_key) if args.api_key else None
