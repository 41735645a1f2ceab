"""SpecDecoder: a loaded target/draft pair with text in, text out; the object the CLI, server and bench share."""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

from specdec.config import ModelRef, SamplingParams, SpecConfig
from specdec.drafters import create_drafter
from specdec.engine.output import Generation, StepOutput
from specdec.engine.scheduler import BatchEngine
from specdec.engine.single import SpeculativeEngine
from specdec.loading.models import load_pair


class SpecDecoder:
    """Holds the backends; builds a speculative engine per SpecConfig and the plain baseline on the same weights."""

    def __init__(self, target, draft=None, spec: SpecConfig | None = None):
        self.target = target
        self.draft = draft
        # No spec: the draft model when there is one, else the suffix drafter with adaptive k (the CLI's default
        # too): it costs microseconds where it finds no match, and the policy drafts only where copying pays.
        self.spec = spec or (SpecConfig(drafter="draft_model") if draft is not None
                             else SpecConfig(drafter="suffix", k_policy="adaptive"))
        self.tokenizer = target.tokenizer
        self._batches: dict[SpecConfig, BatchEngine] = {}
        self._engines: dict[SpecConfig, SpeculativeEngine] = {}

    @classmethod
    def load(cls, ref: ModelRef | None = None, spec: SpecConfig | None = None) -> "SpecDecoder":
        ref = ref or ModelRef()
        target, draft = load_pair(
            ref.target, ref.draft, ref.weight_format, ref.max_context, draft_weight_format=ref.draft_weight_format,
            backend=ref.backend, threads=ref.threads, batch_invariant=ref.batch_invariant,
            device=ref.device, parallel=ref.parallel,
        )
        return cls(target, draft, spec)

    def batch_engine(self, spec: SpecConfig | None = None) -> BatchEngine:
        """The batch engine for spec (cached, so caches are allocated once and policies keep what they learnt);
        drafter 'none' gives plain decoding. A server sets how many sequences it runs together."""
        spec = spec or self.spec
        if spec not in self._batches:
            drafter = None
            if spec.drafter != "none":
                drafter = create_drafter(spec.drafter, draft_backend=self.draft, spec=spec)
            self._batches[spec] = BatchEngine(self.target, drafter, spec)
        return self._batches[spec]

    def engine(self, spec: SpecConfig | None = None) -> SpeculativeEngine:
        """One request at a time on the batch engine for spec (cached too)."""
        spec = spec or self.spec
        if spec not in self._engines:
            self._engines[spec] = SpeculativeEngine.on(self.batch_engine(spec))
        return self._engines[spec]

    def plain_engine(self) -> SpeculativeEngine:
        return self.engine(SpecConfig(drafter="none"))

    def encode(self, prompt: str, chat: bool | None = None, system: str | None = None) -> list[int]:
        """Tokenize a prompt; chat=None applies the tokenizer's chat template when it has one."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass token ids instead of text")
        use_chat = bool(getattr(self.tokenizer, "chat_template", None)) if chat is None else chat
        if use_chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            return self.encode_chat(messages)
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def encode_chat(self, messages: Sequence[dict], check_text: Callable[[str], None] | None = None) -> list[int]:
        """Apply the chat template and tokenize; `check_text` sees the templated text first and may refuse it
        (raise), so text that cannot fit is never tokenized."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use a completion prompt")
        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        if check_text is not None:
            check_text(text)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams, spec: SpecConfig | None = None) -> Generation:
        return self.engine(spec).generate(prompt_ids, params)

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams, spec: SpecConfig | None = None) -> Iterator[StepOutput]:
        return self.engine(spec).stream(prompt_ids, params)
