"""The tools bench: BFCL's verdict rules (with the answers they must refuse), its type names as JSON schema, a
seeded sample, and a whole run on a tiny GGUF with a tool-calling template."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from specdec.bench.tools.problems import json_schema, openai_tools, sample_problems
from specdec.bench.tools.scoring import answer_is_right, call_matches

TESTS_DIR = Path(__file__).resolve().parent
EXPECTED = {"spotify.play": {"artist": ["Taylor Swift"], "duration": [20], "shuffle": [False, ""]}}


def test_a_call_is_right_by_bfcl_rules_and_wrong_otherwise():
    right = {"name": "spotify_play", "arguments": {"artist": "taylor swift", "duration": 20.0}}
    assert call_matches(right, EXPECTED)  # dotted names as OpenAI's _, strings standardised, 20.0 == 20
    assert call_matches({**right, "arguments": {**right["arguments"], "shuffle": False}}, EXPECTED)
    for wrong in ({**right, "name": "spotify_pause"},  # another function
                  {**right, "arguments": {"artist": "Taylor Swift"}},  # a required argument missing
                  {**right, "arguments": {**right["arguments"], "duration": 21}},  # a value not accepted
                  {**right, "arguments": {**right["arguments"], "volume": 3}},  # an argument it does not take
                  {**right, "arguments": {**right["arguments"], "shuffle": "no"}}):
        assert not call_matches(wrong, EXPECTED), wrong


def test_parallel_answers_match_in_any_order_and_count():
    truth = [{"f": {"x": [1]}}, {"f": {"x": [2, 1]}}]
    one, two = {"name": "f", "arguments": {"x": 1}}, {"name": "f", "arguments": {"x": 2}}
    assert answer_is_right([two, one], truth) and answer_is_right([one, two], truth)
    assert answer_is_right([one, one], truth)  # the second call accepts 1 too: a full matching exists
    assert not answer_is_right([one], truth) and not answer_is_right([one, two, two], truth)
    assert not answer_is_right([two, two], truth)


def test_bfcl_types_become_json_schema_and_the_sample_is_fixed():
    schema = json_schema({"type": "dict", "properties": {"r": {"type": "float"}, "p": {"type": "tuple", "items": {
        "type": "integer"}}, "a": {"type": "any"}}, "required": ["r"]})
    assert schema == {"type": "object", "properties": {"r": {"type": "number"}, "p": {"type": "array", "items": {
        "type": "integer"}}, "a": {}}, "required": ["r"]}
    first = [p.id for p in sample_problems("parallel", 5, 45)]
    assert first == [p.id for p in sample_problems("parallel", 5, 45)] and len(set(first)) == 5
    assert first != [p.id for p in sample_problems("parallel", 5, 46)]
    tools = openai_tools(sample_problems("multiple", 1, 45)[0])
    assert len(tools) > 1 and all("." not in t["function"]["name"] for t in tools)
    assert all(t["function"]["parameters"]["type"] == "object" for t in tools)


def test_tools_bench_end_to_end_on_a_tiny_gguf(tmp_path):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("httpx")
    pytest.importorskip("jsonschema")
    sys.path.insert(0, str(TESTS_DIR))
    from specdec.cli import main as cli
    from tiny_gguf import write_tiny_gguf

    model = write_tiny_gguf(tmp_path / "tools.gguf", seed=0, tools=True, context=4096)
    out = tmp_path / "out"
    code = cli.main(["bench", "--tools", str(model), "--tools-sample", "1", "--tools-structured", "1",
                     "--tools-systems", "reference,ours", "--threads", "1", "--request-timeout", "120",
                     "--out", str(out)])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    sets = results["summary"]["sets"]
    assert set(sets) == {"simple", "multiple", "parallel", "structured"}
    for entry in sets.values():
        assert all(row["errors"] == 0 and row["problems"] == 1 for row in entry["systems"].values())
    assert sets["structured"]["systems"]["ours"]["forced_share"] > 0  # the schema's keys need no drafter
    assert results["environment"]["lscpu"] and (out / "results.md").read_text().startswith("# specdec bench --tools")
