"""Fuzzing the configuration-file reader: whatever the file holds, the answer is settings or one line.

``load_config_file`` followed by ``resolve`` and ``validate`` (what ``ringtrain
train --config FILE`` does) may return a configuration or raise
:class:`UsageError` with a one-line message; any other exception would reach
the user as a traceback.
"""

import json
import math
import os
import tempfile

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringtrain.training.config import FIELDS, load_config_file, resolve, validate
from ringtrain.errors import UsageError

KEYS = st.one_of(st.sampled_from(sorted(FIELDS)), st.sampled_from([n.replace("_", "-") for n in FIELDS]),
                 st.sampled_from(["train", "epoch", "batch", "x", ""]), st.text(max_size=8))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=12), st.sampled_from(["auto", "none", "mlp", "softmax", "skip", "sgd", "8,4"]))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                      max_leaves=6)
DOCUMENTS = st.dictionaries(KEYS, VALUES, max_size=6)
# Text biased towards both syntaxes' punctuation, for documents that do not parse.
NOISE = st.text(alphabet=st.sampled_from(list("abcdehilnoprstx_-019.=:[]{}\"',#\n \t\\") + ["\x00", "é"]),
                max_size=80)


def toml_value(value):
    if value is None:  # TOML has no null; an empty string is the nearest thing
        return '""'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if not (isinstance(value, float) and math.isinf(value)) else "inf"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def toml_document(doc):
    return "".join(f"{json.dumps(k)} = {toml_value(v)}\n" for k, v in doc.items())


def check(text, ext):
    fd, path = tempfile.mkstemp(suffix=ext)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
        try:
            validate(resolve({}, load_config_file(path)))
        except UsageError as exc:
            message = str(exc)
            assert message and "\n" not in message and "\r" not in message, repr(message)
    finally:
        os.unlink(path)


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(DOCUMENTS)
def test_any_yaml_document_gives_settings_or_one_line(doc):
    check(yaml.safe_dump(doc, allow_unicode=True), ".yaml")


@FUZZ
@given(DOCUMENTS)
def test_any_toml_document_gives_settings_or_one_line(doc):
    check(toml_document(doc), ".toml")


@FUZZ
@given(NOISE, st.sampled_from([".toml", ".yaml", ".yml"]))
def test_any_text_gives_settings_or_one_line(text, ext):
    check(text, ext)


@FUZZ
@given(st.binary(max_size=60), st.sampled_from([".toml", ".yaml"]))
def test_any_bytes_give_settings_or_one_line(data, ext):
    check(data, ext)
