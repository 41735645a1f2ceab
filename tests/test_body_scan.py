"""The unparsed count of a JSON body's structure: equal to a character-by-character reference at every window size,
never below the values a parser builds, and refusing in the guard before the app parses anything."""

from __future__ import annotations

import json
import random

import pytest

from specdec.server.body_scan import may_exceed, structure_counts


def reference_count(body: bytes) -> int:
    """Commas and opening brackets outside strings, by reading the JSON text one character at a time."""
    count, inside, escaped = 0, False, False
    for byte in body:
        char = chr(byte)
        if inside:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                inside = False
        elif char == '"':
            inside = True
        elif char in ",[{":
            count += 1
    return count


def parsed_values(value) -> int:
    """Array items and object members, counted on the parsed value."""
    if isinstance(value, list):
        return len(value) + sum(parsed_values(item) for item in value)
    if isinstance(value, dict):
        return len(value) + sum(parsed_values(item) for item in value.values())
    return 0


TRICKY_TEXT = ['', ',', '"', '\\', '\\"', '\\\\', '\\\\"', '[{,}]', 'a,b', '\\u00e9,', '"\\"",', 'é,ü', '\n,\t']


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(6 if depth < 4 else 3)
    if kind == 0:
        return "".join(rng.choice(TRICKY_TEXT) for _ in range(rng.randrange(6)))
    if kind == 1:
        return rng.randrange(-5, 10**6)
    if kind == 2:
        return rng.choice([True, False, None, 1.5])
    if kind in (3, 4):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {"".join(rng.choice(TRICKY_TEXT) for _ in range(3)): random_value(rng, depth + 1)
            for _ in range(rng.randrange(5))}


@pytest.mark.parametrize("seed", range(40))
def test_the_count_equals_a_character_by_character_reading_at_any_window(seed):
    rng = random.Random(seed)
    body = json.dumps(random_value(rng), ensure_ascii=rng.random() < 0.5).encode()
    expected = reference_count(body)
    for window in (1, 2, 3, 7, 64, len(body) + 1):
        counts = list(structure_counts(body, window))
        assert (counts[-1] if counts else 0) == expected, (window, body)
        assert counts == sorted(counts)  # a running total, one per window
    assert expected >= parsed_values(json.loads(body))  # a bound on what a parser would build


def test_text_full_of_commas_and_brackets_counts_nothing():
    body = json.dumps({"prompt": 'f(a, b)[0], {"k": [1, 2]}, \\' * 10_000}).encode()
    assert list(structure_counts(body))[-1] == 1  # only the object's own brace
    assert reference_count(body) == 1


def test_a_window_never_cuts_an_escape():
    # Backslash runs of every length straddling every window edge: an escape cut in two would flip the
    # string state and count the commas inside the text.
    for run in range(1, 6):
        body = json.dumps(["\\" * run + '",,,' * 3, ",,"]).encode()
        for window in range(1, len(body) + 1):
            assert list(structure_counts(body, window))[-1] == reference_count(body) == 2, (run, window)


def test_invalid_windows_and_short_bodies():
    with pytest.raises(ValueError):
        list(structure_counts(b"[]", 0))
    assert list(structure_counts(b"")) == []
    assert not may_exceed(b"[1,2,3]", 7) and may_exceed(b"[1,2,3]", 6)
