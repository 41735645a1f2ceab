"""Token log-probabilities in OpenAI's shapes: chat's `logprobs.content` entries (token, logprob, bytes,
top_logprobs) and completions' `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`; the EOS token that
ends a reply is not listed (OpenAI lists the text's tokens)."""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence
from typing import Any

from specdec.core.logprobs import TokenLogprob


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character -> byte map, which byte-level BPE vocabularies (Qwen's, Llama 3's) spell tokens in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    codes, extra = {}, 0
    for b in range(256):
        if b in printable:
            codes[chr(b)] = b
        else:
            codes[chr(256 + extra)] = b
            extra += 1
    return codes


class LogprobShaper:
    """One request's log-probabilities as OpenAI writes them; keeps the completion text offset across chunks."""

    def __init__(self, tokenizer, eos: Collection[int], list_eos: bool = False):
        self.tokenizer = tokenizer
        # An echoed prompt's scores are read by position (lm-evaluation-harness drops the last entry, the
        # generated token's): there an EOS the model chose is listed too, so every position is there.
        self.eos = frozenset() if list_eos else frozenset(eos)
        self.offset = 0

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - one shaper per request, a bounded cache
    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (its byte-level spelling read back; else its decoded text)."""
        spelled = self.tokenizer.convert_ids_to_tokens(int(token))
        table = _byte_decoder()
        if isinstance(spelled, str) and spelled and all(ch in table for ch in spelled):
            return bytes(table[ch] for ch in spelled)
        return self.tokenizer.decode([int(token)]).encode("utf-8")

    def text(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", "replace")

    def _listed(self, logprobs: Sequence[TokenLogprob] | None) -> list[TokenLogprob]:
        return [lp for lp in logprobs or () if lp.token not in self.eos]

    def chat(self, logprobs: Sequence[TokenLogprob] | None) -> dict[str, Any]:
        def entry(token: int, logprob: float) -> dict[str, Any]:
            return {"token": self.text(token), "logprob": logprob, "bytes": list(self.token_bytes(token))}

        return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top]}
                            for lp in self._listed(logprobs)], "refusal": None}

    def completion(self, logprobs: Sequence[TokenLogprob] | None) -> dict[str, Any]:
        listed = self._listed(logprobs)
        texts = [self.text(lp.token) for lp in listed]
        return {"tokens": texts, "token_logprobs": [lp.logprob for lp in listed],
                "top_logprobs": [{self.text(t): p for t, p in lp.top} for lp in listed],
                "text_offset": self._offsets(texts)}

    def _offsets(self, texts: Sequence[str]) -> list[int]:
        """Each text's offset in the reply so far (completions' text_offset), the running offset moved past them."""
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        return offsets

    def prompt(self, prompt_ids: Sequence[int], scored: Sequence[TokenLogprob] | None) -> dict[str, Any]:
        """An echoed prompt in completions' shape: its first token has no log-probability (nothing precedes
        it: null, as OpenAI writes it), each other token the prefill row's before it."""
        ids = list(prompt_ids)
        scored = list(scored or ())
        texts = [self.text(t) for t in ids]
        return {"tokens": texts, "token_logprobs": [None] + [lp.logprob for lp in scored][: len(ids) - 1],
                "top_logprobs": [None] + [{self.text(t): p for t, p in lp.top} for lp in scored][: len(ids) - 1],
                "text_offset": self._offsets(texts)}

    def shape(self, kind: str, logprobs: Sequence[TokenLogprob] | None) -> dict[str, Any]:
        return self.chat(logprobs) if kind == "chat" else self.completion(logprobs)


def joined(first: dict[str, Any] | None, then: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two completions-shaped logprobs objects as one (an echoed prompt's, then the completion's)."""
    if first is None or then is None:
        return first if then is None else then
    return {key: list(first[key]) + list(then[key]) for key in first}
