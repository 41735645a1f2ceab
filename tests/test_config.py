"""Config dataclasses: validation with clear messages, immutability, JSON round-trip."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from specdec.config import (
    WEIGHT_FORMATS,
    ConfigError,
    ModelRef,
    SamplingParams,
    SpecConfig,
    from_json,
    to_json,
)


def test_defaults_are_greedy_and_valid():
    params = SamplingParams()
    assert params.greedy and params.temperature == 0 and params.stop == ()
    assert not SamplingParams(temperature=0.5).greedy
    assert SpecConfig().num_speculative_tokens == 5
    assert ModelRef().weight_format in WEIGHT_FORMATS


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 3.0}, "max_tokens"),
        ({"stop": ("",)}, "stop"),
        ({"stop": (1,)}, "stop"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_sampling_params_refuse_bad_values(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment) as info:
        SamplingParams(**kwargs)
    if fragment != "stop":  # the message quotes the offending value
        assert repr(next(iter(kwargs.values()))) in str(info.value)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_stop_is_normalised_to_a_tuple():
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    hash(SamplingParams(stop=["a"]))  # hashable once normalised


def test_configs_are_frozen_and_hashable():
    params = SamplingParams(temperature=0.7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 1.0  # type: ignore[misc]
    spec = SpecConfig(num_speculative_tokens=3)
    assert {spec: 1}[SpecConfig(num_speculative_tokens=3)] == 1


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 65}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2.0}, "num_speculative_tokens"),
        ({"draft_p_min": 1.0}, "draft_p_min"),
        ({"draft_p_min": -0.5}, "draft_p_min"),
        ({"k_policy": "greedy"}, "k_policy"),
        ({"lookup_min_ngram": 0}, "n-gram"),
        ({"lookup_min_ngram": 4, "lookup_max_ngram": 3}, "n-gram"),
    ],
)
def test_spec_config_refuses_bad_values(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        SpecConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"target": ""}, "target"),
        ({"weight_format": "int4"}, "weight format"),
        ({"max_context": 8}, "max_context"),
        ({"max_context": 100.0}, "max_context"),
    ],
)
def test_model_ref_refuses_bad_values(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        ModelRef(**kwargs)


@pytest.mark.parametrize(
    "obj",
    [
        SamplingParams(),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, max_tokens=7, stop=("\n\n", "END"),
                       seed=42, ignore_eos=True),
        SpecConfig(),
        SpecConfig(num_speculative_tokens=8, drafter="prompt_lookup", draft_p_min=0.3, k_policy="heuristic",
                   lookup_max_ngram=4, lookup_min_ngram=2),
        ModelRef(),
        ModelRef(target="org/model@v1", draft=None, weight_format="bf16", max_context=2048, trust_remote_code=True),
    ],
)
def test_json_round_trip(obj):
    text = to_json(obj)
    assert json.loads(text)["type"] == type(obj).__name__
    back = from_json(text)
    assert back == obj and type(back) is type(obj)


def test_from_json_validates_and_refuses_unknown_input():
    with pytest.raises(ConfigError, match="temperature"):
        from_json(json.dumps({"type": "SamplingParams", "temperature": -1}))
    with pytest.raises(ConfigError, match="unknown fields"):
        from_json(json.dumps({"type": "SpecConfig", "k": 3}))
    with pytest.raises(ConfigError, match="unknown config type"):
        from_json(json.dumps({"type": "Nope"}))
    with pytest.raises(ConfigError, match="unknown config type"):
        from_json(json.dumps({"temperature": 1.0}))
