"""specdec public API: load a target/draft pair, then generate or stream losslessly with speculative decoding."""

import importlib
from typing import TYPE_CHECKING

from specdec.host.amx_guard import keep_onednn_off_amx

keep_onednn_off_amx()  # before torch computes anything (see host/amx_guard.py)

from specdec.config import ConfigError, ModelRef, SamplingParams, SpecConfig  # noqa: E402
from specdec.version import __version__  # noqa: E402

if TYPE_CHECKING:
    from specdec.decoder import SpecDecoder

# The names that need torch are imported on first use (PEP 562), so `import specdec` (and the `specdec`
# console script, which imports this package first) costs milliseconds: a Ctrl-C during torch's import
# then lands in the command's handler, which reports it in one line, not in a traceback from here.
_LAZY = {
    "Chunk": "specdec.engine.output", "Generation": "specdec.engine.output", "StepOutput": "specdec.engine.output",
    "SpeculativeEngine": "specdec.engine.single", "plain_engine": "specdec.engine.single",
    "BatchEngine": "specdec.engine.scheduler", "SpecStats": "specdec.core.stats", "SpecDecoder": "specdec.decoder",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load(target: str = "default", draft: str | None = "auto", weight_format: str = "fp32",
         max_context: int = 4096, spec: SpecConfig | None = None,
         draft_weight_format: str | None = "int8", backend: str = "auto", threads: int | None = None,
         exact: bool = False) -> "SpecDecoder":
    """Load a model pair ('default' = the packaged Qwen2.5-Coder 1.5B target and 0.5B draft).

    backend: "auto" (llama.cpp for .gguf files and the default pair on CPU, torch otherwise), "torch" or
    "llama.cpp". Weight formats apply to the torch backend; llama.cpp runs GGUF weights as stored.
    exact: llama.cpp target with batch-invariant kernels (greedy output bit-identical to plain decoding);
    default False: llama.cpp's fastest kernels, lossless in distribution.
    draft: "auto" (default) is the packaged 0.5B draft for the packaged target and none for any other
    target (no silent pair); without a draft model the decoder drafts with prompt lookup.
    """
    if draft == "auto":
        draft = "default" if target == "default" else None
    ref = ModelRef(target, draft, weight_format, max_context, draft_weight_format=draft_weight_format,
                   backend=backend, threads=threads, batch_invariant=exact)
    return __getattr__("SpecDecoder").load(ref, spec)


__all__ = [
    "BatchEngine", "Chunk", "ConfigError", "Generation", "ModelRef", "SamplingParams", "SpecConfig", "SpecDecoder",
    "SpecStats", "SpeculativeEngine", "StepOutput", "load", "plain_engine", "__version__",
]


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
