"""`specdec serve`: load the pair in the background and serve the OpenAI-compatible API with uvicorn."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys


# Slots when --parallel is not given and the target runs on llama.cpp: llama-server's automatic count (-np -1).
# Measured on the 2-vCPU AVX-512 EPYC, one client, 30 chat and code prompts (benchmarks/epyc-2core): 4 slots ran
# as fast as 1 (19.2 vs 17.6 tok/s in the same run) for 287 MiB more memory (KV room for four).
AUTO_PARALLEL = 4


def resolved_parallel(args: argparse.Namespace) -> int:
    """--parallel as given, else AUTO_PARALLEL where the target would load on llama.cpp, else 1 (a torch target:
    its static GPU decoder runs each sequence's forward on its own, so slots there interleave rather than batch).
    Sets args.parallel to the result, so every later reader sees one number."""
    if args.parallel is None:
        from specdec.cli.flags import model_ref_from_args
        from specdec.config import ConfigError
        from specdec.loading.models import ModelLoadError, backend_for

        try:
            ref = model_ref_from_args(args)
            backend = backend_for(ref.target, ref.backend, ref.device)
        except (ConfigError, ModelLoadError, OSError, ValueError):
            backend = None  # the load says what is wrong with the model; one slot until then
        args.parallel = AUTO_PARALLEL if backend == "llama.cpp" else 1
    return args.parallel


def register(commands) -> None:
    """Add the `serve` subcommand to the `specdec` argparse subparsers."""
    from specdec.cli.flags import add_model_arguments, add_spec_arguments
    from specdec.server.limits import (
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_READ_TIMEOUT,
    DEFAULT_SHUTDOWN_GRACE,
)

    serve = commands.add_parser(
        "serve", help="run an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics)",
        description="Serve a target/draft pair over an OpenAI-compatible API. Up to --parallel requests are "
        "generated together (continuous batching); others wait in a first-come-first-served queue.",
    )
    add_model_arguments(serve)
    add_spec_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY") or None,
                       help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECDEC_API_KEY, else no "
                       "authentication)")
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
    serve.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                       help="Host header names accepted (any port), checked against DNS rebinding. Default: "
                       "localhost, 127.0.0.1 and [::1] when bound to loopback without --api-key, else no check; "
                       "'*' turns the check off")
    from specdec.server.ray_cli import add_ray_arguments

    add_ray_arguments(serve)
    serve.set_defaults(handler=run_serve)


def served_names(args: argparse.Namespace) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    if args.model == "default":
        from specdec.loading.models import DEFAULT_MODELS

        return [DEFAULT_MODELS["default-target"].label]
    return [args.model]


def _limits_from_args(args: argparse.Namespace):
    from specdec.cli.main import UserError
    from specdec.server.limits import ServerLimits

    for flag, value in (("--max-request-bytes", args.max_request_bytes), ("--max-queue", args.max_queue),
                        ("--parallel", 1 if args.parallel is None else args.parallel)):
        if value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    if not 0 < args.read_timeout < math.inf:
        raise UserError(f"--read-timeout must be positive, got {args.read_timeout:g}")
    # The cheap checks above come first; an unset --parallel then asks where the target would run.
    return ServerLimits(args.max_request_bytes, args.max_queue, args.read_timeout, resolved_parallel(args))


def run_serve(args: argparse.Namespace) -> int:
    from specdec.cli.main import UserError
    from specdec.cli.flags import model_ref_from_args, spec_from_args

    try:
        import uvicorn

        from specdec.server.app import create_app
        from specdec.server.http_protocol import header_deadline_protocol
        from specdec.server.limits import host_check_list, is_loopback
        from specdec.server.shutdown import GracefulServer
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise UserError(f"the server needs its extras: pip install 'specdec[server]' ({exc.name} is missing)")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    limits = _limits_from_args(args)
    if not args.shutdown_grace >= 0:  # inf waits for the running request to finish; nan is refused
        raise UserError(f"--shutdown-grace must be at least 0, got {args.shutdown_grace:g}")
    allowed_hosts = host_check_list(args.host, args.api_key, args.allowed_hosts)
    # Everything cheap is checked before minutes are spent loading models.
    ref = dataclasses.replace(model_ref_from_args(args), parallel=args.parallel)
    spec = spec_from_args(args, has_draft_model=ref.draft is not None)
    from specdec.server.ray_cli import ray_requested, run_ray_serve

    if ray_requested(args):  # N replicas on Ray Serve, each loading its own pair (ray_serve.py)
        return run_ray_serve(args)

    def load():
        from specdec.decoder import SpecDecoder

        return SpecDecoder.load(ref, spec)

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    failure: list[BaseException] = []
    server_box: list = []

    def on_load_error(exc: BaseException) -> None:
        failure.append(exc)
        if server_box:
            server_box[0].should_exit = True

    app = create_app(loader=load, served_model_name=served_names(args), api_key=args.api_key,
                     on_load_error=on_load_error, limits=limits, allowed_hosts=allowed_hosts)
    # The drain (GracefulServer) ends every request; uvicorn's own graceful timeout is only for writing the
    # last bytes of those responses.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5,
                            http=header_deadline_protocol(limits.read_timeout))
    server = GracefulServer(config, drain=lambda: app.state.specdec.drain(args.shutdown_grace))
    server_box.append(server)
    together = f"{args.parallel} request{'s' if args.parallel > 1 else ''} generated together (--parallel)"
    print(f"specdec serve: loading {ref.target} (draft: {ref.draft or 'none'}), {together}; listening on "
          f"http://{args.host}:{args.port} (/health is 503 until the models are ready)", file=sys.stderr)
    if args.api_key is None and not is_loopback(args.host):
        print(f"specdec serve: warning: {args.host} is reachable from other machines and no --api-key is set",
              file=sys.stderr)
    server.run()
    if failure:
        raise failure[0] if isinstance(failure[0], Exception) else UserError(str(failure[0]))
    return 0
