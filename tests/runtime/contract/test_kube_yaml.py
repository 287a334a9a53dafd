"""YAML read as kubectl reads it (Go's floats, integral floats sent as integers), and safe."""

from __future__ import annotations

import math

import pytest
import yaml

from rolloutrun_runtime.contract.kube_yaml import load_yaml, load_yaml_all


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1e3", 1000),  # PyYAML alone: the string "1e3"
        ("1.0e3", 1000),  # PyYAML alone: a string (its exponent needs a sign)
        ("+1e3", 1000),
        ("-2E-2", -0.02),
        ("30.0", 30),  # kubectl's JSON writes 30
        ("0.003", 0.003),
        ("1e21", 1e21),  # Go's JSON writes 1e+21: a float still
        ("30", 30),
        ("0777", 511),  # YAML 1.1 octal, in Go's YAML too
        ("yes", True),
        ("1e", "1e"),
        ("e3", "e3"),
        ("1.2.3", "1.2.3"),
        ('"1e3"', "1e3"),  # quoted: a string in both
    ],
)
def test_a_plain_scalar_reads_as_kubectl_sends_it(text, value):
    got = load_yaml(f"a: {text}")["a"]
    assert got == value and type(got) is type(value)


def test_infinity_and_nan_stay_floats():
    assert load_yaml("a: .inf")["a"] == math.inf
    assert math.isnan(load_yaml("a: .nan")["a"])


def test_only_plain_data_is_built():
    with pytest.raises(yaml.YAMLError):
        load_yaml("a: !!python/object/apply:os.system ['true']")


def test_pyyaml_itself_is_unchanged():
    assert yaml.safe_load("a: 1e3")["a"] == "1e3"
    assert yaml.safe_load("a: 30.0")["a"] == 30.0


def test_every_document_of_a_stream():
    assert load_yaml_all("a: 1e1\n---\n---\nb: 2\n") == [{"a": 10}, None, {"b": 2}]
