"""`specdec serve`: load the pair in the background and serve the OpenAI-compatible API with uvicorn."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys

from specdec.cli.flags import model_ref_from_args, spec_from_args
from specdec.decoder import SpecDecoder
from specdec.errors import ConfigError, UserError
from specdec.server.app import create_app
from specdec.server.http_protocol import header_deadline_protocol
from specdec.server.limits import host_check_list, is_loopback
from specdec.server.options import (
    add_serve_arguments,
    limits_from_args,
    ray_requested,
    served_names,
    tenants_from_args,
)
from specdec.server.ray_cli import run_ray_serve
from specdec.server.shutdown import GracefulServer


def register(commands) -> None:
    """Add the `serve` subcommand to the `specdec` argparse subparsers."""
    serve = commands.add_parser(
        "serve", help="run an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics)",
        description="Serve a target/draft pair over an OpenAI-compatible API. Up to --parallel requests are "
        "generated together (continuous batching); others wait in a first-come-first-served queue.",
    )
    add_serve_arguments(serve)
    serve.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn  # the server extra; without it `specdec serve` is registered as a refusal that names it

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    limits = limits_from_args(args)
    if not args.shutdown_grace >= 0:  # inf waits for the running request to finish; nan is refused
        raise UserError(f"--shutdown-grace must be at least 0, got {args.shutdown_grace:g}")
    tenants = tenants_from_args(args)
    allowed_hosts = host_check_list(args.host, args.api_key or args.api_keys, args.allowed_hosts)
    # Everything cheap is checked before minutes are spent loading models.
    ref = dataclasses.replace(model_ref_from_args(args), parallel=args.parallel)
    spec = spec_from_args(args, has_draft_model=ref.draft is not None)

    if ray_requested(args):  # N replicas on Ray Serve, each loading its own pair (ray_serve.py)
        return run_ray_serve(args)

    def load():
        return SpecDecoder.load(ref, spec)

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    failure: list[BaseException] = []
    server_box: list = []

    def on_load_error(exc: BaseException) -> None:
        failure.append(exc)
        if server_box:
            server_box[0].should_exit = True

    app = create_app(loader=load, served_model_name=served_names(args), tenants=tenants,
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
    if tenants is None and not is_loopback(args.host):
        print(f"specdec serve: warning: {args.host} is reachable from other machines and no --api-key is set",
              file=sys.stderr)
    if tenants is not None and tenants.path is not None:
        signal.signal(signal.SIGHUP, lambda *_: _reload_keys(tenants))
    server.run()
    if failure:
        raise failure[0] if isinstance(failure[0], Exception) else UserError(str(failure[0]))
    return 0


def _reload_keys(tenants) -> None:
    try:
        tenants.reload()
        logging.getLogger("specdec.server").info("API keys re-read from %s", tenants.path)
    except ConfigError as exc:  # the keys in force stay; the operator reads why in the log
        logging.getLogger("specdec.server").error("API keys not re-read: %s", exc)
