"""What a bench run records about where it ran: CPU, threads, library versions, the models and their backends."""

from __future__ import annotations

import os
import platform

import torch

from specdec.host.native_build import cpu_model
from specdec.version import __version__


def environment(decoder, weight_format: str | None = None) -> dict:
    """Versions and hardware, so results from different machines are never compared blindly."""
    import transformers  # slow to import: here, not at CLI start

    def describe(backend):
        if backend is None:
            return None
        if hasattr(backend, "describe"):
            return backend.describe()
        model = getattr(backend, "model", None)
        out = {"name": getattr(backend, "name", "?"), "max_context": getattr(backend, "max_context", None),
               "class": type(model).__name__ if model is not None else type(backend).__name__, "backend": "torch"}
        config = getattr(model, "config", None)
        if config is not None:
            # From the config: packed/quantized linears hold their weights outside nn.Parameters.
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
            for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size"):
                out[key] = getattr(text, key, None)
        return out

    return {
        "specdec": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "quantized_engine": torch.backends.quantized.engine,
        "cuda": torch.cuda.is_available(),
        "weight_format": weight_format,
        "target": describe(decoder.target),
        "draft": describe(decoder.draft),
    }


def torch_threads() -> int:
    return torch.get_num_threads()
