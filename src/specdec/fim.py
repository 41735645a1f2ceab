"""Fill-in-the-middle prompts: a model's FIM token ids, and prefix/suffix/extra files laid out in llama.cpp's order.

Editors ask for the code between a prefix and a suffix. A FIM model was trained on one layout of
special tokens; `infill_prompt` writes llama-server's (`format_prompt_infill`), so a request sent to
specdec and to llama-server becomes the same token ids: the extra files as repository context
(`FIM_REP myproject\\n`, then `FIM_SEP filename\\n text` per file, then `FIM_SEP filename\\n` for the
file being edited), then `[BOS] FIM_PRE prefix prompt FIM_SUF suffix FIM_MID` (suffix first with SPM
order). The text of the prefix, suffix and extra files is tokenized as plain text: special-token
text in a user's file never becomes a control token. Pure functions; the tokenizer is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

# Token texts llama.cpp recognises as FIM tokens when a GGUF names no ids (src/llama-vocab.cpp), per model family:
# Qwen, StarCoder, Granite, DeepSeek, CodeLlama, GLM-4.5, Falcon-H1.
FIM_TEXTS: dict[str, tuple[str, ...]] = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>", "\u2581<PRE>",
            "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>", "\u2581<SUF>",
            "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>", "\u2581<MID>",
            "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
# GGUF metadata keys naming the ids (newer conversions write them; llama.cpp reads these first).
FIM_GGUF_KEYS = {role: f"tokenizer.ggml.fim_{role}_token_id" for role in FIM_TEXTS}

# llama-server's constants: the repository name and the current file's name it writes, the separator of extra
# chunks for models without FIM_SEP, and the default filename of a chunk that names none.
REPO_NAME = "myproject\n"
CURRENT_FILE = "filename\n"
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"
DEFAULT_CHUNK_FILENAME = "tmp"


@dataclass(frozen=True)
class FimTokens:
    """A model's FIM special-token ids (None where it has none) and the BOS it puts first (None: no BOS)."""

    pre: int | None = None
    suf: int | None = None
    mid: int | None = None
    pad: int | None = None
    rep: int | None = None
    sep: int | None = None
    bos: int | None = None

    @property
    def missing(self) -> list[str]:
        """The tokens infilling needs that this model lacks (llama-server's words: prefix, suffix, middle)."""
        return [name for name, value in (("prefix", self.pre), ("suffix", self.suf), ("middle", self.mid))
                if value is None]

    @property
    def supported(self) -> bool:
        return not self.missing

    def unsupported_message(self) -> str:
        """llama-server's error text for a model that cannot infill."""
        return "Infill is not supported by this model: " + "".join(f"{name} token is missing. "
                                                                  for name in self.missing)

    def ids(self) -> frozenset[int]:
        return frozenset(v for v in (self.pre, self.suf, self.mid, self.pad, self.rep, self.sep) if v is not None)


def detect_fim_tokens(vocab: Mapping[str, int], metadata: Mapping[str, object] | None = None,
                      bos: int | None = None) -> FimTokens:
    """FIM ids as llama.cpp finds them: the GGUF metadata keys first, else the first known token text present
    (in FIM_TEXTS order), per role."""
    found: dict[str, int | None] = {}
    for role, texts in FIM_TEXTS.items():
        value = (metadata or {}).get(FIM_GGUF_KEYS[role])
        if value is not None and int(value) >= 0:
            found[role] = int(value)
            continue
        found[role] = next((vocab[text] for text in texts if text in vocab), None)
    return FimTokens(**found, bos=bos)


@dataclass(frozen=True)
class ExtraChunk:
    """Another file's text given as context (llama-server's input_extra item)."""

    text: str
    filename: str = DEFAULT_CHUNK_FILENAME


@dataclass(frozen=True)
class InfillWindow:
    """How much of each part a prompt may take, llama-server's rule: the prefix's last 3/4 of a batch, the
    suffix's first 1/4 (less the prompt's tokens and two FIM tokens), the extra context's last
    context - batch - 2 x n_predict tokens."""

    batch: int = 2048
    context: int = 4096
    predict: int = -1  # the server's n_predict as llama-server counts it (-1: no reservation)

    @property
    def prefix_tokens(self) -> int:
        return 3 * (self.batch // 4)

    def suffix_tokens(self, prompt_tokens: int) -> int:
        return max(0, self.batch // 4 - (2 + prompt_tokens))

    @property
    def extra_tokens(self) -> int:
        return max(0, self.context - self.batch - 2 * self.predict)


@dataclass
class InfillPrompt:
    """The prompt's token ids, and what the window dropped (tokens cut from each part; 0: nothing)."""

    ids: list[int]
    dropped: dict[str, int] = field(default_factory=dict)

    @property
    def truncated(self) -> bool:
        return any(self.dropped.values())


def extra_context_ids(tokens: FimTokens, chunks: Sequence[ExtraChunk], encode_text: Callable[[str], list[int]]) -> list[int]:
    """The repository context block, before any window: llama-server writes the repository and current-file
    markers whenever the model has those tokens, extra files or not."""
    out: list[int] = []
    if tokens.rep is not None:
        out += [tokens.rep, *encode_text(REPO_NAME)]
    for chunk in chunks:
        if tokens.sep is not None:
            out += [tokens.sep, *encode_text(chunk.filename + "\n")]
        else:
            out += encode_text(SNIPPET_SEPARATOR)
        out += encode_text(chunk.text)
    if tokens.sep is not None:
        out += [tokens.sep, *encode_text(CURRENT_FILE)]
    return out


def infill_prompt(tokens: FimTokens, encode_text: Callable[[str], list[int]], prefix: str, suffix: str,
                  prompt_ids: Sequence[int] = (), extra: Sequence[ExtraChunk] = (),
                  window: InfillWindow | None = InfillWindow(), spm: bool = False) -> InfillPrompt:
    """The FIM prompt for prefix + prompt (text typed after it, already tokenized) ... suffix, in llama-server's
    order, each part held to its window (the far end of the prefix, the near end of the suffix, the latest
    extra context are kept; window None keeps everything). `encode_text` tokenizes plain text: no BOS,
    special-token text stays text."""
    if not tokens.supported:
        raise ValueError(tokens.unsupported_message().strip())
    prompt_ids = [int(t) for t in prompt_ids]
    prefix_ids, suffix_ids = encode_text(prefix), encode_text(suffix)
    extra_ids = extra_context_ids(tokens, extra, encode_text)
    keep_prefix, keep_suffix, keep_extra = len(prefix_ids), len(suffix_ids), len(extra_ids)
    if window is not None:
        keep_prefix = min(keep_prefix, window.prefix_tokens)
        keep_suffix = min(keep_suffix, window.suffix_tokens(len(prompt_ids)))
        keep_extra = min(keep_extra, window.extra_tokens)
    dropped = {"prefix": len(prefix_ids) - keep_prefix, "suffix": len(suffix_ids) - keep_suffix,
               "extra": len(extra_ids) - keep_extra}
    prefix_part = [tokens.pre, *prefix_ids[len(prefix_ids) - keep_prefix:], *prompt_ids]
    suffix_part = [tokens.suf, *suffix_ids[:keep_suffix]]
    first, second = (suffix_part, prefix_part) if spm else (prefix_part, suffix_part)
    bos = [tokens.bos] if tokens.bos is not None else []
    ids = [*extra_ids[len(extra_ids) - keep_extra:], *bos, *first, *second, tokens.mid]
    return InfillPrompt(ids, dropped)

