"""Progress bars only for work that lasts: inside `long_work_bars()`, transformers' bars draw after LONG_WORK_SECONDS.

transformers draws a "Loading weights" bar even for a load that takes milliseconds, and so prints it before
an error that follows at once (a prompt too long, a draft with another vocabulary). tqdm's `delay` keeps a
bar hidden until its work has run that long: a quick load, or one that fails first, prints no bar; a long
one (a 7B checkpoint, de-quantizing a GGUF) still shows its progress.
"""

from __future__ import annotations

from contextlib import contextmanager

LONG_WORK_SECONDS = 2.0


def delayed_bar(factory, args: tuple, kwargs: dict):
    """A tqdm hook (transformers.utils.logging.set_tqdm_hook): the bar it was asked for, drawn only after a delay."""
    return factory(*args, **{"delay": LONG_WORK_SECONDS, **kwargs})


@contextmanager
def long_work_bars():
    """Delay transformers' progress bars for the duration (the previous hook is restored: library users keep theirs).

    A transformers without the hook (older than 5) keeps its bars as they are.
    """
    from transformers.utils import logging as hf_logging  # slow to import: here, not at CLI start

    set_hook = getattr(hf_logging, "set_tqdm_hook", None)
    if set_hook is None:
        yield
        return
    previous = getattr(hf_logging, "_tqdm_hook", None)
    set_hook(delayed_bar)
    try:
        yield
    finally:
        set_hook(previous)


__all__ = ["LONG_WORK_SECONDS", "delayed_bar", "long_work_bars"]
