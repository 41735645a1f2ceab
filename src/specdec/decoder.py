"""SpecDecoder: a loaded target/draft pair with text in, text out; the object the CLI, server and bench share."""

from __future__ import annotations

import functools
import re
from typing import Callable, Iterator, Sequence

from specdec.config import ModelRef, SamplingParams, SpecConfig
from specdec.drafters import create_drafter
from specdec.engine.output import Generation, StepOutput
from specdec.engine.scheduler import BatchEngine
from specdec.engine.single import SpeculativeEngine
from specdec.fim import ExtraChunk, FimTokens, InfillPrompt, InfillWindow, infill_prompt
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

    def encode_chat(self, messages: Sequence[dict], check_text: Callable[[str], None] | None = None,
                    tools: Sequence[dict] | None = None) -> list[int]:
        """Apply the model's own chat template (transformers renders it in a sandboxed jinja2 environment, with
        `tools` as the template expects them) and tokenize; `check_text` sees the templated text first and may
        refuse it (raise), so text that cannot fit is never tokenized. Special-token text inside a message (a
        user pasting `<|im_end|>` or `<|fim_prefix|>`) stays text: only the template writes control tokens."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use a completion prompt")
        messages = list(messages)
        tools = list(tools) if tools else None
        text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        if check_text is not None:
            check_text(text)
        if not any(self._special_text.search(str(m.get("content", ""))) for m in messages):
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])  # the common case, as ever
        return chat_ids_keeping_content_text(self.tokenizer, messages, self.encode_text, tools)

    @functools.cached_property
    def chat_template(self) -> str | None:
        """The text of the model's default chat template (None without one)."""
        template = getattr(self.tokenizer, "chat_template", None) if self.tokenizer is not None else None
        if isinstance(template, dict):  # named templates: the default one
            template = template.get("default")
        return template if isinstance(template, str) and template else None

    @functools.cached_property
    def added_vocab(self) -> dict[str, int]:
        """The tokenizer's added tokens, text -> id (a tool-call tag may be one of them)."""
        return dict(self.tokenizer.get_added_vocab()) if self.tokenizer is not None else {}

    def encode_text(self, text: str) -> list[int]:
        """Plain text to ids: no BOS, and special-token text tokenized as the characters it is."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass token ids instead of text")
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    @functools.cached_property
    def fim_tokens(self) -> FimTokens:
        """The target's fill-in-the-middle tokens (FimTokens.supported: whether it can infill)."""
        return self.target.fim_tokens()

    def encode_infill(self, prefix: str, suffix: str, prompt: str = "", extra: Sequence[ExtraChunk] = (),
                      window: InfillWindow | None = InfillWindow()) -> InfillPrompt:
        """A FIM prompt in llama-server's layout (fim.infill_prompt); every text part is plain text. Raises
        ValueError naming the missing tokens when the target cannot infill."""
        return infill_prompt(self.fim_tokens, self.encode_text, prefix, suffix, self.encode_text(prompt), extra,
                             window)

    @functools.cached_property
    def _special_text(self) -> re.Pattern:
        """Matches the text of any special (control) token of the tokenizer; never matches without one."""
        texts = sorted((t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special),
                       key=len, reverse=True)
        return re.compile("|".join(map(re.escape, texts)) if texts else r"(?!)")

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams, spec: SpecConfig | None = None) -> Generation:
        return self.engine(spec).generate(prompt_ids, params)

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams, spec: SpecConfig | None = None) -> Iterator[StepOutput]:
        return self.engine(spec).stream(prompt_ids, params)


def chat_ids_keeping_content_text(tokenizer, messages: Sequence[dict], encode_text: Callable[[str], list[int]],
                                  tools: Sequence[dict] | None = None) -> list[int]:
    """The chat template's ids with each message's content tokenized as plain text: the template is rendered
    with a private-use placeholder per message, its own text tokenized with control tokens, the contents
    without. A template that does not copy each content through once cannot be split so: ValueError."""
    marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
    stand_ins = [{**m, "content": mark} if isinstance(m.get("content"), str) else m for m, mark in zip(messages, marks)]
    rendered = tokenizer.apply_chat_template(stand_ins, tools=tools, tokenize=False, add_generation_prompt=True)
    pieces = re.split("\ue000(\\d+)\ue001", rendered)
    used = [int(i) for i in pieces[1::2]]
    if sorted(used) != [i for i, m in enumerate(messages) if isinstance(m.get("content"), str)]:
        raise ValueError("special-token text in a message cannot be kept as text with this chat template")
    ids: list[int] = []
    for index, piece in enumerate(pieces):
        if index % 2:
            ids += encode_text(messages[int(piece)]["content"])
        elif piece:
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
    return ids
