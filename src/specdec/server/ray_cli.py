"""`specdec serve --replicas N`: start Ray, deploy the application (ray_serve.py) on Ray Serve's proxy, serve until
a signal, then take it down. Ray is imported only when replicas are asked for: `pip install 'specdec[ray]'`."""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading

from specdec.errors import UserError
from specdec.server.limits import is_loopback
from specdec.server.options import scaling_from_args


def run_ray_serve(args: argparse.Namespace) -> int:
    """Start (or join) Ray, deploy the application on Ray Serve's proxy at --host/--port, serve until SIGINT or
    SIGTERM, then delete it (and stop the Ray instance this command started)."""
    try:
        import ray  # the ray extra, needed only with --replicas
        from ray import serve  # the ray extra

        # ray_serve declares its deployments with Ray's decorators at import (the ray extra), so it comes with Ray.
        from specdec.server.ray_serve import APP_NAME, ENGINE, build_application  # the ray extra
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise UserError(f"--replicas needs Ray Serve: pip install 'specdec[ray]' ({exc.name} is missing)")
    scaling = scaling_from_args(args)
    joined = args.ray_address is not None
    ray.init(address=args.ray_address if joined else "local", include_dashboard=None if joined else False,
             logging_level=args.log_level.upper(), log_to_driver=args.log_level == "debug")
    signal.signal(signal.SIGTERM, _interrupt)  # while loading, SIGTERM stops it as Ctrl-C does
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        how = (f"autoscaling {scaling.min_replicas or 1}..{scaling.max_replicas} replicas" if scaling.autoscaling
               else f"{scaling.replicas} replica(s)")
        print(f"specdec serve: {how} of {args.model} (draft: {args.draft or 'none'}), {args.threads} thread(s) and "
              f"{scaling.replica_cpus:g} CPU(s) each, on Ray Serve; loading ...", file=sys.stderr, flush=True)
        if args.api_key is None and not is_loopback(args.host):
            print(f"specdec serve: warning: {args.host} is reachable from other machines and no --api-key is set",
                  file=sys.stderr)
        try:
            serve.run(build_application(args, scaling), name=APP_NAME, route_prefix="/", blocking=False)
        except Exception as exc:  # noqa: BLE001 - a replica that cannot load fails the deployment
            raise UserError(f"the replicas did not start: {_why_not_started(serve, APP_NAME, ENGINE) or exc}") from exc
        print(f"specdec serve: ready on http://{args.host}:{args.port} (/v1/*, /health, /metrics, /replicas)",
              file=sys.stderr, flush=True)
        stop = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        while not stop.wait(1.0):
            pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the shutdown below is bounded; a second Ctrl-C waits for it
        print("specdec serve: shutting down", file=sys.stderr, flush=True)
        # Bounded: a Ctrl-C in a terminal reaches the whole process group, a local Ray's own processes too, and
        # Serve's calls then wait for a cluster that is gone; ray.shutdown() below stops what is left.
        cleanup = threading.Thread(target=_delete_app, args=(serve, APP_NAME, not joined), daemon=True)
        cleanup.start()
        wait = args.shutdown_grace + SHUTDOWN_MARGIN_SECONDS
        cleanup.join(None if math.isinf(wait) else wait)
        if cleanup.is_alive():
            print("specdec serve: Ray did not confirm the shutdown in time; stopping anyway", file=sys.stderr)
        ray.shutdown()
    return 0


def _why_not_started(serve, app_name: str, engine: str) -> str | None:
    """The engine deployment's own account of its failure: the last line of the error a replica raised."""
    try:
        message = serve.status().applications[app_name].deployments[engine].message
    except Exception:  # noqa: BLE001 - only a better message is lost
        return None
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    return lines[-1] if lines else None


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


SHUTDOWN_MARGIN_SECONDS = 20.0


def _delete_app(serve, name: str, whole_serve: bool) -> None:
    try:
        if whole_serve:  # our own Ray instance: Serve's controller and proxy go too
            serve.shutdown()
        else:
            serve.delete(name)
    except Exception as exc:  # noqa: BLE001 - reported, the process still exits
        print(f"specdec serve: shutdown: {exc}", file=sys.stderr)


__all__ = ["run_ray_serve"]
