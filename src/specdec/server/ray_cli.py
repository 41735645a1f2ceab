"""`specdec serve --replicas N`: the Ray Serve flags of `specdec serve`, their checks, and the run (Ray is
imported only when they are used: `pip install 'specdec[ray]'`). The application itself: ray_serve.py."""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading

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
        from specdec.cli.main import UserError

        raise UserError(f"--{stray[0].replace('_', '-')} applies to replicas on Ray Serve: add --replicas N "
                        "(or --min-replicas/--max-replicas)")
    return False


def scaling_from_args(args: argparse.Namespace):
    """The replicas' count, autoscaling bounds and reservations, checked; fills in --threads (per replica)."""
    from specdec.cli.main import UserError
    from specdec.server.ray_serve import Scaling

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
    from specdec.server.cli import resolved_parallel

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


def run_ray_serve(args: argparse.Namespace) -> int:
    """Start (or join) Ray, deploy the application on Ray Serve's proxy at --host/--port, serve until SIGINT or
    SIGTERM, then delete it (and stop the Ray instance this command started)."""
    from specdec.cli.main import UserError
    from specdec.server.limits import is_loopback

    try:
        import ray
        from ray import serve

        from specdec.server.ray_serve import APP_NAME, build_application
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
            raise UserError(f"the replicas did not start: {_why_not_started(serve) or exc}") from exc
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


def _why_not_started(serve) -> str | None:
    """The engine deployment's own account of its failure: the last line of the error a replica raised."""
    from specdec.server.ray_serve import APP_NAME, ENGINE

    try:
        message = serve.status().applications[APP_NAME].deployments[ENGINE].message
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


__all__ = ["add_ray_arguments", "ray_requested", "run_ray_serve", "scaling_from_args"]
