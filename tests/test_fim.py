"""Fill-in-the-middle prompts (specdec.fim): token discovery by GGUF key and by text, llama-server's layout and its
windows against hand-written references, and llama.cpp's own FIM ids for a tiny GGUF agreeing with the tokenizer's."""

from __future__ import annotations

import pytest

from specdec.fim import (
    FIM_GGUF_KEYS,
    ExtraChunk,
    FimTokens,
    InfillWindow,
    detect_fim_tokens,
    extra_context_ids,
    infill_prompt,
)

TOKENS = FimTokens(pre=-10, suf=-11, mid=-12, pad=-13, rep=-14, sep=-15)


def chars(text: str) -> list[int]:
    """A stand-in tokenizer: one id per character (its code point), so every part is visible in the ids."""
    return [ord(c) for c in text]


def test_tokens_are_found_by_their_text_as_llama_cpp_finds_them():
    vocab = {"<|fim_prefix|>": 5, "<|fim_suffix|>": 6, "<|fim_middle|>": 7, "<|repo_name|>": 8, "<|file_sep|>": 9,
             "a": 0}
    found = detect_fim_tokens(vocab)
    assert (found.pre, found.suf, found.mid, found.pad, found.rep, found.sep) == (5, 6, 7, None, 8, 9)
    assert found.supported and found.bos is None
    codellama = detect_fim_tokens({"\u2581<PRE>": 1, "\u2581<SUF>": 2, "\u2581<MID>": 3})
    assert (codellama.pre, codellama.suf, codellama.mid, codellama.rep, codellama.sep) == (1, 2, 3, None, None)


def test_gguf_keys_come_before_the_texts():
    metadata = {FIM_GGUF_KEYS["pre"]: 40, FIM_GGUF_KEYS["suf"]: 41, FIM_GGUF_KEYS["mid"]: -1}
    found = detect_fim_tokens({"<|fim_prefix|>": 5, "<|fim_middle|>": 7}, metadata)
    assert (found.pre, found.suf, found.mid) == (40, 41, 7)  # -1 is llama.cpp's "none": the text decides


def test_a_model_without_fim_tokens_says_which_are_missing():
    tokens = detect_fim_tokens({"<|fim_prefix|>": 5, "hello": 1})
    assert not tokens.supported and tokens.missing == ["suffix", "middle"]
    assert tokens.unsupported_message() == ("Infill is not supported by this model: suffix token is missing. "
                                            "middle token is missing. ")
    with pytest.raises(ValueError, match="suffix token is missing"):
        infill_prompt(tokens, chars, "a", "b")


def test_llama_server_layout_with_repository_context():
    extra = [ExtraChunk("X=1\n", "a.py"), ExtraChunk("Y", "b.py")]
    built = infill_prompt(TOKENS, chars, "def f(", "):\n", prompt_ids=chars("x"), extra=extra)
    expected = ([-14, *chars("myproject\n"), -15, *chars("a.py\n"), *chars("X=1\n"), -15, *chars("b.py\n"),
                 *chars("Y"), -15, *chars("filename\n")]
                + [-10, *chars("def f("), *chars("x"), -11, *chars("):\n"), -12])
    assert built.ids == expected and not built.truncated


def test_without_repository_tokens_the_markers_go_and_chunks_get_llama_servers_separator():
    plain = FimTokens(pre=-10, suf=-11, mid=-12)
    assert infill_prompt(plain, chars, "p", "s").ids == [-10, *chars("p"), -11, *chars("s"), -12]
    chunk = extra_context_ids(plain, [ExtraChunk("T")], chars)
    assert chunk == chars("\n\n--- snippet ---\n\nT")


def test_bos_and_spm_order():
    with_bos = FimTokens(pre=-10, suf=-11, mid=-12, sep=-15, bos=-1)
    built = infill_prompt(with_bos, chars, "p", "s", spm=True)
    # the extra block (here the current-file marker) goes before BOS, as llama-server puts it
    assert built.ids == [-15, *chars("filename\n"), -1, -11, *chars("s"), -10, *chars("p"), -12]


def test_windows_keep_the_near_prefix_the_near_suffix_and_the_latest_extra():
    window = InfillWindow(batch=16, context=40, predict=4)  # prefix 12, suffix 4 - 2 - prompt, extra 40-16-8 = 16
    assert (window.prefix_tokens, window.suffix_tokens(0), window.extra_tokens) == (12, 2, 16)
    prefix, suffix = "abcdefghijklmnopqrst", "UVWXYZ"
    built = infill_prompt(TOKENS, chars, prefix, suffix, extra=[ExtraChunk("0123456789")], window=window)
    extra_all = extra_context_ids(TOKENS, [ExtraChunk("0123456789")], chars)
    assert built.ids == [*extra_all[-16:], -10, *chars(prefix[-12:]), -11, *chars("UV"), -12]
    assert built.dropped == {"prefix": 8, "suffix": 4, "extra": len(extra_all) - 16} and built.truncated
    # a prompt (text after the prefix) takes the suffix's room; none left is allowed
    assert infill_prompt(TOKENS, chars, "p", suffix, prompt_ids=chars("qq"), window=window).dropped["suffix"] == 6
    assert infill_prompt(TOKENS, chars, prefix, suffix, window=None).dropped == {"prefix": 0, "suffix": 0,
                                                                                 "extra": 0}


# --------------------------------------------------------------------------------------------- a tiny FIM GGUF


@pytest.fixture(scope="module")
def fim_ggufs(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from tiny_gguf import write_tiny_gguf

    root = tmp_path_factory.mktemp("fim")
    return {"fim": write_tiny_gguf(root / "fim.gguf", seed=0, fim=True),
            "plain": write_tiny_gguf(root / "plain.gguf", seed=0)}


def test_llama_cpp_and_the_tokenizer_find_the_same_fim_ids(fim_ggufs, tmp_path):
    from specdec.backends.base import ModelBackend
    from specdec.loading.gguf_tokenizer import load_gguf_tokenizer
    from specdec.loading.models import load_backend
    from tiny_gguf import FIM_IDS

    backend = load_backend(str(fim_ggufs["fim"]), role="target", max_context=256, threads=1)
    try:
        ours = backend.fim_tokens()
        assert (ours.pre, ours.mid, ours.suf, ours.pad, ours.rep, ours.sep) == tuple(FIM_IDS.values())
        assert ours.bos is None  # the tiny file, like Qwen's, adds no BOS
        # the default rule (by text in the converted tokenizer) is an independent path to the same ids
        tokenizer = load_gguf_tokenizer(fim_ggufs["fim"], tmp_path)
        by_text = ModelBackend.fim_tokens(type("TokenizerOnly", (), {"tokenizer": tokenizer})())
        assert by_text == ours
    finally:
        backend.close()
    plain = load_backend(str(fim_ggufs["plain"]), role="target", max_context=256, threads=1)
    try:
        assert plain.fim_tokens().missing == ["prefix", "suffix", "middle"]
    finally:
        plain.close()
