"""Incremental detokenization: deltas add up to the text, stop strings cut it, partial matches are held back."""

from __future__ import annotations

import itertools
import random
from typing import Callable, Sequence

import pytest

from specdec.engine.textstream import TextStream

WORDS = {i: w for i, w in enumerate(["Hel", "lo", " wor", "ld", "!", " E", "N", "D", " more", "\n", "\n", "x"])}


def decode_words(ids):
    return "".join(WORDS[i] for i in ids)


def run(stream: TextStream, batches, flush=True) -> list[str]:
    deltas = [stream.push(batch) for batch in batches]
    if flush and not stream.stopped:
        deltas.append(stream.flush())
    return deltas


def test_no_stop_deltas_concatenate_to_the_full_text():
    stream = TextStream(decode_words)
    deltas = run(stream, [[0], [1, 2], [3], [4]])
    assert deltas[:4] == ["Hel", "lo wor", "ld", "!"]
    assert "".join(deltas) == "Hello world!"
    assert not stream.stopped


def test_stop_string_cuts_the_text_and_stops():
    stream = TextStream(decode_words, stop=["END"])
    deltas = run(stream, [[0, 1], [5, 6, 7, 8], [4]])
    assert "".join(deltas) == "Hello "
    assert stream.stopped
    assert stream.push([4]) == ""  # nothing after a stop


def test_partial_stop_is_held_back_until_resolved():
    stream = TextStream(decode_words, stop=[" END"])
    assert stream.push([0, 1]) == "Hello"
    assert stream.push([5]) == ""  # " E" could be the start of " END"
    assert stream.push([6]) == ""  # " EN" still could
    assert stream.push([4]) == " EN!"  # resolved: not a stop
    assert stream.flush() == ""
    assert not stream.stopped


def test_held_back_text_is_released_by_flush():
    stream = TextStream(decode_words, stop=[" END"])
    assert stream.push([0, 1, 5]) == "Hello"
    assert stream.flush() == " E"


def test_stop_spanning_many_tokens_and_earliest_of_several():
    stream = TextStream(decode_words, stop=["ld!", "lo w"])
    deltas = run(stream, [[0], [1], [2], [3], [4]])
    assert "".join(deltas) == "Hel"  # "lo w" occurs before "ld!"
    assert stream.stopped


def test_stop_at_the_very_start():
    stream = TextStream(decode_words, stop=["Hel"])
    assert stream.push([0, 1]) == ""
    assert stream.stopped


def test_newline_stop_made_of_two_tokens():
    stream = TextStream(decode_words, stop=["\n\n"])
    assert stream.push([0, 9]) == "Hel"  # the lone "\n" is held back
    assert stream.push([10, 11]) == ""
    assert stream.stopped and stream.text == "Hel"


def test_incomplete_utf8_is_held_back():
    pieces = {0: b"caf", 1: b"\xc3", 2: b"\xa9", 3: b"!"}

    def decode_bytes(ids):
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    stream = TextStream(decode_bytes)
    assert stream.push([0, 1]) == "caf"  # "\ufffd" for the half character is not shown
    assert stream.push([2]) == "é"
    assert stream.push([3]) == "!"


def test_random_batching_never_shows_stop_text_and_always_adds_up():
    """Property test: for any split of the token stream, streamed text is always a prefix of the final text."""
    rng = random.Random(0)
    vocab = ["a", "b", "ab", "ba", "c", "bc", "\n"]
    stops_choices = [("abc",), ("ba", "cc"), ("\n",), ("bab", "ca"), ()]
    for _ in range(300):
        ids = [rng.randrange(len(vocab)) for _ in range(rng.randrange(1, 15))]
        stops = rng.choice(stops_choices)

        def decode(seq):
            return "".join(vocab[i] for i in seq)

        full = decode(ids)
        cuts = [full.find(s) for s in stops if s in full]
        expected = full[: min(cuts)] if cuts else full
        # split into random batches
        batches, i = [], 0
        while i < len(ids):
            j = i + rng.randrange(1, 4)
            batches.append(ids[i:j])
            i = j
        stream = TextStream(decode, stops)
        shown = ""
        for batch in batches:
            shown += stream.push(batch)
            assert expected.startswith(shown), (full, stops, shown)
            assert not any(s in shown for s in stops)
        if not stream.stopped:
            shown += stream.flush()
        assert shown == expected, (full, stops, batches)
        assert stream.stopped == bool(cuts)


@pytest.mark.parametrize("stop", ["aaa", "aab"])
def test_repetitive_text_with_overlapping_stop(stop):
    for n in range(1, 8):
        for split in itertools.product([1, 2], repeat=3):
            stream = TextStream(lambda ids: "".join("ab"[i] for i in ids), [stop])
            ids = [0] * n + [1, 0]
            shown, i = "", 0
            for size in itertools.cycle(split):
                if i >= len(ids) or stream.stopped:
                    break
                shown += stream.push(ids[i : i + size])
                i += size
            if not stream.stopped:
                shown += stream.flush()
            text = "a" * n + "ba"
            cut = text.find(stop)
            assert shown == (text[:cut] if cut >= 0 else text), (n, split, stop)


class _ReferenceTextStream:
    """The TextStream before it decoded incrementally (it decoded all the tokens on every push, and every
    prefix of a push on a stop): the reference the incremental one must match exactly."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()):
        self.decode = decode
        self.stop = tuple(stop)
        self.tokens: list[int] = []
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def push(self, tokens: Sequence[int]) -> str:
        if self.stopped:
            return ""
        before = len(self.tokens)
        self.tokens.extend(tokens)
        text = self.decode(self.tokens)
        search_from = max(0, self.emitted - max((len(s) for s in self.stop), default=0))
        cut = _ref_first_stop(text, self.stop, search_from)
        if cut is not None:
            for end in range(before + 1, len(self.tokens)):
                prefix = self.decode(self.tokens[:end])
                found = _ref_first_stop(prefix, self.stop, search_from)
                if found is not None:
                    text, cut = prefix, found
                    del self.tokens[end:]
                    break
            self.stopped = True
            self.text = text[:cut]
            return self._take(len(self.text))
        self.text = text
        safe = len(text)
        if text.endswith("\ufffd"):
            safe = len(text.rstrip("\ufffd"))
        safe = min(safe, len(text) - _ref_partial_stop_suffix(text, self.stop))
        return self._take(safe)

    def flush(self) -> str:
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta = self.text[self.emitted : upto]
        self.emitted = upto
        return delta


def _ref_first_stop(text, stops, start):
    """The first position at or after start where a stop string begins, by trying every position (None: none)."""
    for position in range(start, len(text) + 1):
        if any(text.startswith(stop, position) for stop in stops):
            return position
    return None


def _ref_partial_stop_suffix(text, stops):
    """The longest end of text that is a proper beginning of a stop string, by trying every length."""
    return max((size for stop in stops for size in range(1, len(stop))
                if size <= len(text) and text[len(text) - size:] == stop[:size]), default=0)


def assert_same_as_reference(decode, ids, stops, rng, context="", strict_text=True):
    """Push ids in random chunks (empty ones too, a flush now and then) into both; every observable agrees.

    strict_text=False: for a decoder that changes text already shown when more tokens come (see the
    SentencePiece runs test), the texts are compared only where the reference's begins with what it handed
    out, and there are no flushes before the end (one would hand out U+FFFD that later changes)."""
    stream, reference = TextStream(decode, stops), _ReferenceTextStream(decode, stops)
    shown, i = "", 0
    while i <= len(ids) and not reference.stopped:
        size = rng.choice([0, 1, 1, 1, 2, 3, 5, 8])
        chunk = ids[i : i + size]
        i += size if i < len(ids) else 1  # the last push may be empty
        where = (context, ids, stops, chunk)
        delta = reference.push(chunk)
        assert stream.push(chunk) == delta, where
        shown += delta
        assert stream.tokens == reference.tokens, where
        if strict_text or reference.text.startswith(shown):
            assert stream.text == reference.text, where
        assert (stream.stopped, stream.emitted) == (reference.stopped, reference.emitted), where
        if strict_text and rng.random() < 0.03:
            delta = reference.flush()
            assert stream.flush() == delta, where
            shown += delta
    assert stream.flush() == reference.flush()
    assert (stream.text, stream.emitted) == (reference.text, reference.emitted)


def random_stops(rng, text, pool):
    """0-3 stop strings: pieces of the text (so they occur across token and push boundaries) or from pool."""
    stops = []
    for _ in range(rng.randrange(4)):
        if text and rng.random() < 0.7:
            start = rng.randrange(len(text))
            stops.append(text[start : start + rng.randrange(1, 5)])
        else:
            stops.append(rng.choice(pool))
    return stops


PIECES = ["the", " the", " héllo", " 日本語", "😀", "🇯🇵", "\n", "\n\n", "    return x", " for", "é", "中文。", "!",
          " ", "def f(x):", "👩‍💻", " naïve", "Ω≈ç"]
STOP_POOL = ["\n\n", "the", "日本", "😀", "x", "。", "return", "é!", "\ufffd"]


def byte_level_tokenizer():
    """A byte-level BPE PreTrainedTokenizerFast over tests/tiny_gguf.py's vocabulary (the 256 byte tokens,
    a few merges, ChatML specials), built in memory: multi-byte characters split into one token per byte."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tiny_gguf import SPECIALS, vocabulary

    tokens, _, merges = vocabulary()
    core = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                merges=[tuple(m.split(" ")) for m in merges]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=core, clean_up_tokenization_spaces=False)


def sentencepiece_tokenizer():
    """A Llama-style tokenizer: "▁" words, <0xNN> byte fallback, and a decoder that drops the leading space
    of the first piece, so decode(a + b) != decode(a) + decode(b)."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    pieces = specials + [f"<0x{b:02X}>" for b in range(256)] + [
        "▁", "▁the", "▁hello", "wor", "ld", "▁日本", "語", "a", "b", ".", "▁.", "▁▁", "\n", "▁x"]
    core = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>",
                                byte_fallback=True))
    core.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    core.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, clean_up_tokenization_spaces=False,
                                        unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    return tokenizer, pieces


def test_byte_level_tokenizer_matches_the_reference():
    tokenizer = byte_level_tokenizer()

    def decode(ids):
        return tokenizer.decode(list(ids), skip_special_tokens=True)  # as the engine's default decoder

    rng = random.Random(1)
    for case in range(250):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randrange(1, 10)))
        ids = tokenizer(text)["input_ids"]
        for _ in range(rng.randrange(3)):  # a special token (decodes to nothing) or a lone byte (bad UTF-8)
            ids.insert(rng.randrange(len(ids) + 1), rng.choice([len(tokenizer) - 1, 0x80, 0xE6, 0xF0, 0x9F]))
        assert_same_as_reference(decode, ids, random_stops(rng, decode(ids), STOP_POOL), rng, case)


def test_sentencepiece_style_decoder_matches_the_reference():
    """Words whose leading space depends on what comes before, and characters split into byte tokens."""
    tokenizer, pieces = sentencepiece_tokenizer()
    index = {p: i for i, p in enumerate(pieces)}
    words = [i for i, p in enumerate(pieces) if not p.startswith("<")]

    def decode(ids):
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    def char_bytes(char):
        return [index[f"<0x{b:02X}>"] for b in char.encode()]

    assert decode([index["▁hello"], index["▁the"]]) != decode([index["▁hello"]]) + decode([index["▁the"]])
    rng = random.Random(2)
    for case in range(250):
        ids = []
        for _ in range(rng.randrange(1, 25)):
            roll = rng.random()
            if roll < 0.6:
                ids.append(rng.choice(words))
            elif roll < 0.85:  # a character split into byte tokens, then a word (see below)
                ids += char_bytes(rng.choice("é日本😀中。👍")) + [rng.choice(words)]
            elif roll < 0.95:
                ids.append(index[rng.choice(["<s>", "</s>"])])
            else:  # a stray byte
                ids += [index[f"<0x{rng.randrange(128, 256):02X}>"], rng.choice(words)]
        stops = random_stops(rng, decode(ids), STOP_POOL + [" the", "a."])
        assert_same_as_reference(decode, ids, stops, rng, case)


def test_sentencepiece_runs_of_byte_characters_give_the_reference_deltas():
    """ByteFallback decodes a run of byte tokens as one: while the last character of a run is incomplete,
    decoding all the tokens turns the whole run into U+FFFD, characters already shown included, and the
    reference's text no longer begins with the deltas it handed out. The incremental stream keeps the shown
    characters in its text (vLLM's detokenizer does the same); the deltas, tokens, stops and the final text
    are the reference's. The stop strings here are ASCII: a partial stop match is not looked for behind an
    incomplete character (in the reference too), so one that begins with a character of such a run may be
    handed out while the reference's text, all U+FFFD there, has nothing to hand out."""
    tokenizer, pieces = sentencepiece_tokenizer()
    index = {p: i for i, p in enumerate(pieces)}
    words = [i for i, p in enumerate(pieces) if not p.startswith("<")]

    def decode(ids):
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    rng = random.Random(5)
    for case in range(250):
        ids = []
        for _ in range(rng.randrange(1, 12)):
            if rng.random() < 0.5:
                ids.append(rng.choice(words))
            else:
                run = "".join(rng.choice("é日本😀中。👍") for _ in range(rng.randrange(1, 4)))
                ids += [index[f"<0x{b:02X}>"] for b in run.encode()]
        stops = [s for s in random_stops(rng, decode(ids), ["the", " x", "a.", "ld"]) if s.isascii()]
        assert_same_as_reference(decode, ids, stops, rng, case, strict_text=False)
    ids = [index[f"<0x{b:02X}>"] for b in "日本".encode()]
    assert decode(ids[:3]) == "日" and decode(ids[:4]) == "\ufffd" * 4  # the premise


def test_numbers_decoder_and_split_utf8_bytes_match_the_reference():
    """The engine's fallback decoder (ids joined by spaces: not the concatenation of its parts) and raw
    UTF-8 split at arbitrary bytes, decoded with errors="replace"."""
    rng = random.Random(3)

    def numbers(ids):
        return " ".join(str(i) for i in ids)

    for case in range(200):
        ids = [rng.randrange(12) for _ in range(rng.randrange(1, 30))]
        stops = random_stops(rng, numbers(ids), ["1 1", "10", " 2"])
        assert_same_as_reference(numbers, ids, stops, rng, case)

    for case in range(200):
        data = "".join(rng.choice(PIECES) for _ in range(rng.randrange(1, 8))).encode()
        if rng.random() < 0.2:
            data += bytes([rng.randrange(128, 256)])  # ends in an incomplete or bad sequence
        chunks, i = [], 0
        while i < len(data):
            j = i + rng.randrange(1, 4)
            chunks.append(data[i:j])
            i = j

        def decode_bytes(ids, chunks=chunks):
            return b"".join(chunks[i] for i in ids).decode("utf-8", errors="replace")

        ids = list(range(len(chunks)))
        stops = random_stops(rng, decode_bytes(ids), STOP_POOL)
        assert_same_as_reference(decode_bytes, ids, stops, rng, case)


def counting(decode):
    """decode, and a list whose sum is how many tokens were passed to it."""
    counts = []

    def counted(ids):
        counts.append(len(ids))
        return decode(ids)

    return counted, counts


def test_decoding_work_is_linear_in_the_output():
    """Pushing n tokens one at a time decodes O(n) tokens in all: the new token and a few before it.

    The reference decoded all the tokens on every push, n(n+1)/2 in all (2,001,000 for n = 2000)."""
    n = 2000
    rng = random.Random(4)
    ids = [rng.randrange(len(WORDS)) for _ in range(n)]
    results = {}
    for kind in (TextStream, _ReferenceTextStream):
        decode, counts = counting(decode_words)
        stream = kind(decode, stop=["<never>", "\n\n\n\n\n\n"])
        shown = "".join(stream.push([token]) for token in ids) + stream.flush()
        results[kind] = shown, stream.tokens, sum(counts)
    assert results[TextStream][:2] == results[_ReferenceTextStream][:2]
    assert results[TextStream][2] < 20 * n
    assert results[_ReferenceTextStream][2] == n * (n + 1) // 2 > 20 * n


def test_decoding_work_is_linear_with_split_characters_and_a_stop_in_a_batch():
    """Multi-byte characters held back until complete, then a stop string completed inside an accepted draft:
    the work stays O(n) (the reference decoded every prefix of the draft again, from the first token)."""
    tokenizer = byte_level_tokenizer()
    ids = tokenizer("日本語 😀 the end " * 200)["input_ids"][:2000]
    n = len(ids)
    draft = tokenizer(" STOP here and more")["input_ids"]
    decode, counts = counting(lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True))
    stream = TextStream(decode, stop=["STOP"])
    shown = "".join(stream.push([token]) for token in ids)
    shown += stream.push(draft)
    assert stream.stopped
    assert shown == tokenizer.decode(ids) + " "
    assert stream.tokens == ids + tokenizer(" STOP")["input_ids"]  # ends at the token that completes "STOP"
    assert sum(counts) < 20 * n
