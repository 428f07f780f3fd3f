import math
import pickle

import pytest

from halserve.sampling_params import SamplingParams, SamplingType


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens (5) must be <= max_tokens (4)"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.1}, "presence_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": math.nan}, "repetition_penalty"),
        ({"stop": ""}, "non-empty"),
        ({"stop": ["ok", ""]}, "non-empty"),
        ({"n": 0}, "n must be"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "42"}, "seed"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias keys"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys"),
        ({"logit_bias": {5: math.inf}}, "logit_bias values"),
        ({"logit_bias": {5: "high"}}, "logit_bias values"),
        ({"logit_bias": [5]}, "logit_bias must be a dict"),
        ({"allowed_token_ids": []}, "must not be empty"),
        ({"allowed_token_ids": [3, -1]}, "allowed_token_ids must be non-negative"),
        ({"allowed_token_ids": 7}, "allowed_token_ids must be a list"),
        ({"bad_words": "fox"}, "bad_words must be a list of strings"),
        ({"bad_words": ["fox", " "]}, "bad_words must be non-blank strings"),
        ({"bad_words": ["fox", 3]}, "bad_words must be non-blank strings"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be an integer >= 1, or -1"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be an integer >= 1, or -1"),
        ({"truncate_prompt_tokens": 2.0}, "truncate_prompt_tokens must be an integer >= 1, or -1"),

    ],
)
def test_invalid_values_raise(kwargs, needle):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert needle in str(info.value)
    # the message quotes the offending value
    bad = next(iter(kwargs.values())) if len(kwargs) == 1 else None
    if bad is not None and not (isinstance(bad, float) and math.isnan(bad)):
        assert repr(bad) in str(info.value) or str(bad) in str(info.value)


def test_n_greedy_message_says_to_raise_temperature():
    with pytest.raises(ValueError, match="temperature > 0"):
        SamplingParams(n=2, temperature=0.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 1},
        {"top_p": 1.0},
        {"temperature": 0.0, "n": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"max_tokens": None, "min_tokens": 100},
        {"min_tokens": 4, "max_tokens": 4},
        {"logprobs": 0},
        {"logprobs": 20},
        {"seed": -7},
        {"n": 4, "temperature": 0.8},
        {"truncate_prompt_tokens": -1},
        {"truncate_prompt_tokens": 1},
        {"bad_words": ["fox", " the dog "]},
    ],
)
def test_valid_edge_cases(kwargs):
    SamplingParams(**kwargs)


def test_normalisation_and_defaults():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None and p.seed is None
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]


def test_sampling_type():
    assert SamplingParams(temperature=0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=0.5).sampling_type is SamplingType.RANDOM
    assert SamplingParams(temperature=0.5, seed=3).sampling_type is SamplingType.RANDOM_SEED


def test_output_text_buffer_length():
    assert SamplingParams().output_text_buffer_length == 0
    assert SamplingParams(stop=["a", "STOP!"]).output_text_buffer_length == 4
    assert SamplingParams(stop=["STOP!"], include_stop_str_in_output=True).output_text_buffer_length == 0


def test_clone_is_independent():
    p = SamplingParams(stop=["x"], stop_token_ids=[5], temperature=0.3)
    c = p.clone()
    c.stop.append("y")
    c.stop_token_ids.append(6)
    assert p.stop == ["x"] and p.stop_token_ids == [5]
    assert c.explicit_fields == p.explicit_fields == {"stop", "stop_token_ids", "temperature"}
    assert pickle.loads(pickle.dumps(p)) == p


def test_generation_config_fills_only_unset_fields():
    p = SamplingParams(temperature=0.2, max_tokens=8)
    p.update_from_generation_config(
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_new_tokens": 512, "repetition_penalty": 1.05,
         "do_sample": True, "bos_token_id": 1}
    )
    assert p.temperature == 0.2 and p.max_tokens == 8  # explicitly set: kept
    assert p.top_p == 0.8 and p.top_k == 20 and p.repetition_penalty == 1.05  # defaults applied


def test_generation_config_explicit_default_value_is_kept():
    # temperature=1.0 equals the default, but the user asked for it: the model default must not win
    p = SamplingParams(temperature=1.0).update_from_generation_config({"temperature": 0.6})
    assert p.temperature == 1.0
    assert SamplingParams().update_from_generation_config({"temperature": 0.6}).temperature == 0.6


def test_generation_config_extra_eos_ids_become_stop_tokens():
    p = SamplingParams().update_from_generation_config({"eos_token_id": [2, 7, 9]}, model_eos_token_id=2)
    assert p.stop_token_ids == [7, 9]
    q = SamplingParams(ignore_eos=True).update_from_generation_config({"eos_token_id": [2, 7]}, model_eos_token_id=2)
    assert q.stop_token_ids == []


def test_generation_config_invalid_default_is_reported():
    with pytest.raises(ValueError, match="generation config.*top_p"):
        SamplingParams().update_from_generation_config({"top_p": 0.0})


def test_token_ids_checked_against_the_vocabulary():
    params = SamplingParams(logit_bias={3: 2.0, 99: -1.0}, allowed_token_ids=[1, 2])
    params.check_token_ids(100)  # in range
    with pytest.raises(ValueError, match=r"logit_bias names token id 99, out of range.*\[0, 49\]"):
        params.check_token_ids(50)
    with pytest.raises(ValueError, match="allowed_token_ids names token id 2"):
        SamplingParams(allowed_token_ids=[1, 2]).check_token_ids(2)


def test_clone_copies_token_lists():
    params = SamplingParams(logit_bias={3: 2.0}, allowed_token_ids=[1, 2])
    copy = params.clone()
    copy.logit_bias[4] = 1.0
    copy.allowed_token_ids.append(9)
    assert params.logit_bias == {3: 2.0} and params.allowed_token_ids == [1, 2]
    assert SamplingParams(logit_bias={}).logit_bias is None  # an empty dict biases nothing


def test_bad_words_are_copied_and_their_token_ids_travel_with_the_params():
    params = SamplingParams(bad_words=("fox",))
    assert params.bad_words == ["fox"] and params.bad_words_token_ids is None  # (set by the InputProcessor)
    params.bad_words_token_ids = [[5], [6, 7]]
    copy = params.clone()
    copy.bad_words.append("dog")
    assert params.bad_words == ["fox"] and copy.bad_words_token_ids == [[5], [6, 7]]
    assert pickle.loads(pickle.dumps(params)).bad_words_token_ids == [[5], [6, 7]]  # (to worker processes)
    assert SamplingParams(bad_words=[]).bad_words is None


@pytest.mark.parametrize(
    "spec, needle",
    [
        ({"regex": "a", "choice": ["a"]}, "exactly one of json, json_object, regex, choice, grammar; got regex, choice"),
        ({}, "got none"),
        ({"xml": "<a/>"}, "unknown field(s) xml"),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"choice": ["a", ""]}, "each choice must be a non-empty string, got ''"),
        ({"json": 5}, "json must be a JSON schema (an object or its text), got 5"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ("json", "structured_outputs must be a StructuredOutputsParams or a dict, got 'json'"),
    ],
)
def test_invalid_structured_outputs_raise(spec, needle):
    with pytest.raises(ValueError) as info:
        SamplingParams(structured_outputs=spec)
    assert needle in str(info.value)


def test_structured_outputs_keys():
    from halserve.structured_output import StructuredOutputsParams

    choice = SamplingParams(structured_outputs={"choice": ['say "hi"', "no"]}).structured_outputs
    assert choice.key == ("grammar", 'root ::= "say \\"hi\\"" | "no"')  # JSON-escaped literals
    schema = {"type": "object", "properties": {"b": {}, "a": {}}}
    assert StructuredOutputsParams(json=schema).key == ("json", '{"type": "object", "properties": {"b": {}, "a": {}}}')
    assert StructuredOutputsParams(json_object=True).key == ("json", '{"type": "object"}')


def test_structured_outputs_without_xgrammar_say_how_to_install(monkeypatch):
    import sys

    from halserve.structured_output import StructuredOutputsParams, validate

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as if not installed
    with pytest.raises(ValueError, match=r"pip install 'halserve\[structured-outputs\]'"):
        validate(StructuredOutputsParams(regex="[0-9]+"))
