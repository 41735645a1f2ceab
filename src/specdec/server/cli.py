"""`specdec serve`: load the pair in the background and serve the OpenAI-compatible API with uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def register(commands) -> None:
    """Add the `serve` subcommand to the `specdec` argparse subparsers."""
    from ..cli_common import add_model_arguments, add_spec_arguments

    serve = commands.add_parser(
        "serve", help="run an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics)",
        description="Serve a target/draft pair over an OpenAI-compatible API. One request is generated at a "
        "time; others wait in a first-come-first-served queue.",
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
    serve.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    serve.set_defaults(handler=run_serve)


def served_names(args: argparse.Namespace) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    if args.model == "default":
        from ..models import DEFAULT_MODELS

        return [DEFAULT_MODELS["default-target"].label]
    return [args.model]


def run_serve(args: argparse.Namespace) -> int:
    from ..cli import UserError
    from ..cli_common import model_ref_from_args, spec_from_args

    try:
        import uvicorn

        from .app import create_app
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise UserError(f"the server needs its extras: pip install 'specdec[server]' ({exc.name} is missing)")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    # Everything cheap is checked before minutes are spent loading models.
    ref = model_ref_from_args(args)
    spec = spec_from_args(args, has_draft_model=ref.draft is not None)
    if spec.drafter == "none" and args.drafter != "none":
        raise UserError("no drafter: give --draft MODEL or --drafter NAME (or --drafter none to serve plainly)")

    def load():
        from ..pipeline import SpecDecoder

        return SpecDecoder.load(ref, spec)

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    failure: list[BaseException] = []
    server_box: list = []

    def on_load_error(exc: BaseException) -> None:
        failure.append(exc)
        if server_box:
            server_box[0].should_exit = True

    app = create_app(loader=load, served_model_name=served_names(args), api_key=args.api_key,
                     on_load_error=on_load_error)
    # On shutdown, open streams get a few seconds; then they are cancelled (which stops their generation).
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    server_box.append(server)
    print(f"specdec serve: loading {ref.target} (draft: {ref.draft or 'none'}); "
          f"listening on http://{args.host}:{args.port} (/health is 503 until the models are ready)",
          file=sys.stderr)
    server.run()
    if failure:
        raise failure[0] if isinstance(failure[0], Exception) else UserError(str(failure[0]))
    return 0
