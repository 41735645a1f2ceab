"""Incremental detokenization: deltas add up to the text, stop strings cut it, partial matches are held back."""

from __future__ import annotations

import itertools
import random

import pytest

from specdec.textstream import TextStream

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
