"""The exact_ methods' target: the bench's llama.cpp target loaded a second time with the exact kernels.

`specdec bench` loads one model pair, on the default (fast) kernels unless --exact is given. The
exact_<method> methods run our engine on a second target backend, the same GGUF file loaded with
batch_invariant=True (what `specdec generate --exact` loads: same threads, context and tokenizer), so the
default kernels and the exact ones are timed in one interleaved run. The draft backend is shared: a draft
only proposes, it never changes what the target accepts, so it needs no exact mode. The second target is
made only when an exact_ method is asked for and freed when the run at this thread count ends
(BenchRunner.close).

The torch backend has one set of kernels, so there is nothing to compare there: exact_ methods are
refused (as they are when the bench's own target already runs the exact kernels, --exact).
"""

from __future__ import annotations

from specdec.backends.llamacpp.backend import LlamaCppBackend, batch_invariance_problems
from specdec.config import ConfigError
from specdec.decoder import SpecDecoder


def exact_missing_reason(target) -> str | None:
    """Why the exact_ methods cannot run beside this target (None: they can)."""
    if not isinstance(target, LlamaCppBackend):
        return ("the exact_ methods compare llama.cpp's exact kernels (--exact) with its default fast ones; "
                "the torch backend has one set of kernels (its plain and speculative methods are already "
                "exact), so run them without the exact_ prefix")
    if target.batch_invariant:
        return ("the target already runs the exact kernels (--exact), so every method here is exact; drop "
                "--exact to time the exact_ methods beside the default fast kernels")
    problems = batch_invariance_problems(getattr(target, "features", None))
    if problems:
        return f"this libllama has no exact mode ({'; '.join(problems)})"
    return None


def load_exact_decoder(decoder):
    """A SpecDecoder over the same GGUF as decoder.target, loaded with the exact kernels, sharing its draft.

    ConfigError when the exact_ methods cannot run beside this decoder (see exact_missing_reason).
    """
    target = decoder.target
    reason = exact_missing_reason(target)
    if reason:
        raise ConfigError(f"the exact_ methods cannot run: {reason}")
    exact = LlamaCppBackend(
        target.gguf_path, name=target.name, max_context=target.max_context, threads=target.threads,
        batch_invariant=True, tokenizer=target.tokenizer,
    )
    if not exact.batch_invariant:  # the library refused (it warned why): exact_ rows would mean nothing
        problems = "; ".join(exact.batch_invariance_problems) or "unknown"
        exact.close()
        raise ConfigError(f"the exact_ methods cannot run: this libllama has no exact mode ({problems})")
    return SpecDecoder(exact, decoder.draft)


def close_exact_decoder(decoder) -> None:
    """Free the exact target's llama.cpp model and context (the shared draft stays with the main pair).

    The engines go first: their draft caches are sequences of the shared draft backend, given back when
    the drafters are collected.
    """
    decoder._engines.clear()
    decoder.target.close()


__all__ = ["close_exact_decoder", "exact_missing_reason", "load_exact_decoder"]
