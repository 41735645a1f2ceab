"""The one record a step gives a request, from the engine to the HTTP layer, and the finished Generation."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.core.logprobs import TokenLogprob
from specdec.core.stats import SpecStats


@dataclass
class StepOutput:
    """What one step gave one request: its tokens, whether each came from the draft, the safe text delta, and,
    on the last record, why it ended ("stop", "length", "abort" or "error", with the error) and its statistics.

    The engine yields these (BatchEngine.step, SpeculativeEngine.stream), the server's worker hands them to the
    HTTP handler unchanged, and the handler writes each as a response chunk. After a stop string the tokens end
    at the one in which the stop string ends and the text where it begins (vLLM's convention).
    """

    request_id: int | None  # None: a request that ended before it reached the engine
    tokens: list[int]
    from_draft: list[bool]
    text: str = ""
    finish_reason: str | None = None  # None while the request runs
    error: BaseException | None = None
    stats: SpecStats | None = None  # the request's statistics so far
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them
    # On the first record, with params.prompt_logprobs: one per prompt token after the first (the first has none).
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


Chunk = StepOutput  # the name the library gave a streamed step before the engine and the server shared one record


@dataclass
class Generation:
    """A finished request: all tokens, the text, why it ended, and its statistics (the StepOutputs joined)."""

    tokens: list[int]
    text: str
    finish_reason: str
    stats: SpecStats
    from_draft: list[bool] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token after the first, when asked for


__all__ = ["Chunk", "Generation", "StepOutput"]
