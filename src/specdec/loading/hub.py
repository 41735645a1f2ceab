"""Hub ids at first contact: one connection attempt decides between the hub, the local cache and a one-line refusal.

Left to itself, huggingface_hub retries a connection that fails five times per file with back-off, printing two
warning lines each time (24 lines and about 50 s for a config and a tokenizer), before transformers gives up
with a two-line message. One TCP connection to the hub (or to the proxy the environment names for it), made
before transformers starts, says at once whether to ask the hub, to read the local cache only, or to stop.
"""

from __future__ import annotations

import socket
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from functools import lru_cache

from huggingface_hub import constants, try_to_load_from_cache

CONNECT_TIMEOUT = 3.0  # seconds; a refused or unresolvable host answers at once, a black hole takes this long


@dataclass(frozen=True)
class HubAccess:
    """How to load one hub id: extra from_pretrained arguments, and a note to print or an error to raise."""

    kwargs: dict = field(default_factory=dict)
    note: str | None = None
    error: str | None = None


def endpoint() -> str:
    """The hub's address (HF_ENDPOINT is honoured by huggingface_hub)."""
    return constants.ENDPOINT


def offline_mode() -> bool:
    """Whether HF_HUB_OFFLINE is set (transformers then reads the cache only, and so do we)."""
    return bool(constants.HF_HUB_OFFLINE)


def hub_cache() -> str:
    return constants.HF_HUB_CACHE


@lru_cache(maxsize=8)
def unreachable_reason(url: str, timeout: float = CONNECT_TIMEOUT) -> str | None:
    """None when a TCP connection to url's host (or to its proxy from the environment) opens, else why not."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    proxy = None if urllib.request.proxy_bypass(host) else urllib.request.getproxies().get(parts.scheme)
    if proxy:
        proxied = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = proxied.hostname or "", proxied.port or 80
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return f"{host}:{port}: {exc.strerror or exc}"


def is_cached(repo_id: str, revision: str | None) -> bool:
    """Whether the hub cache holds this model's config.json at this revision (the file every load reads first)."""
    return isinstance(try_to_load_from_cache(repo_id, "config.json", cache_dir=hub_cache(), revision=revision), str)


def access(repo_id: str, revision: str | None = None) -> HubAccess:
    """Decide how to load a hub id: online as usual, from the cache only (hub unreachable), or not at all."""
    label = repo_id + (f"@{revision}" if revision else "")
    if offline_mode():
        if is_cached(repo_id, revision):
            return HubAccess()
        return HubAccess(error=f"{label} is not in the local hub cache ({hub_cache()}) and HF_HUB_OFFLINE is set: "
                               "download it once with network access, or give a local directory or .gguf file")
    reason = unreachable_reason(endpoint())
    if reason is None:
        return HubAccess()
    if is_cached(repo_id, revision):
        return HubAccess(kwargs={"local_files_only": True},
                         note=f"specdec: cannot reach the hub ({reason}); loading {label} from the local cache")
    return HubAccess(error=f"cannot reach the hub at {endpoint()} ({reason}) and {label} is not in the local hub "
                           f"cache ({hub_cache()}): connect to the network, or give a local directory or .gguf file")


__all__ = ["CONNECT_TIMEOUT", "HubAccess", "access", "endpoint", "is_cached", "offline_mode", "unreachable_reason"]
