"""BFCL's verdict on an answer, after its AST checker: each expected call matched by one call of the same function
(in any order for parallel problems, as many calls as expected), every argument the model gave among the accepted
values, and every required one (an accepted list without "") given. Strings compare case-insensitively with
spaces and punctuation removed, numbers by value (an integer is accepted for a float), as BFCL does."""

from __future__ import annotations

import re
from typing import Any

from specdec.bench.tools.problems import openai_name

_STRIP = re.compile(r"[ ,./\-_*^]")


def _standard(value: Any) -> Any:
    if isinstance(value, str):
        return _STRIP.sub("", value).lower()
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (list, tuple)):
        return [_standard(v) for v in value]
    if isinstance(value, dict):
        return {k: _standard(v) for k, v in value.items()}
    return value


def value_accepted(value: Any, accepted: list) -> bool:
    wanted = _standard(value)
    return any(_standard(a) == wanted for a in accepted if a != "")


def call_matches(call: dict[str, Any], expected: dict[str, dict[str, list]]) -> bool:
    """call: {"name", "arguments": {...}} (an OpenAI call, arguments parsed); expected: one ground-truth entry."""
    (function, arguments), = expected.items()
    if call.get("name") != openai_name(function) or not isinstance(call.get("arguments"), dict):
        return False
    given = call["arguments"]
    if set(given) - set(arguments):
        return False  # an argument the function does not take
    for name, accepted in arguments.items():
        if name in given:
            if not value_accepted(given[name], accepted):
                return False
        elif "" not in accepted:
            return False
    return True


def answer_is_right(calls: list[dict[str, Any]], ground_truth: list[dict[str, dict[str, list]]]) -> bool:
    """As many calls as expected, each expected call matched by a distinct call (any order)."""
    if len(calls) != len(ground_truth):
        return False

    def matched(calls_left: list, expected_left: list) -> bool:  # a full matching, by backtracking (few calls)
        if not expected_left:
            return True
        first, rest = expected_left[0], expected_left[1:]
        return any(call_matches(call, first) and matched(calls_left[:i] + calls_left[i + 1:], rest)
                   for i, call in enumerate(calls_left))

    return matched(list(calls), list(ground_truth))
