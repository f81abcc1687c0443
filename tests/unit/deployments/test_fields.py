"""Gantry's JSONField reads what Django's reads, faster, and falls back where orjson refuses."""

import json

from core.models import Event


def _read_back(data):
    event = Event.objects.create(kind="test.fields", message="m", data=data)
    return Event.objects.values_list("data", flat=True).get(pk=event.pk)


def test_values_read_back_as_django_would(db):
    data = {"name": "ü \u2028", "n": [1, 2.5, -3e-7, None, True], "nested": {"a": {"b": []}}}
    assert _read_back(data) == json.loads(json.dumps(data))


def test_an_integer_beyond_64_bits_reads_back_exactly(db):
    # orjson would read it as a float, 2**70 + 1 as 2**70.
    (value,) = _read_back([2**70 + 1])
    assert type(value) is int and value == 2**70 + 1
    assert _read_back([2**63 - 1, -(2**63)]) == [2**63 - 1, -(2**63)]


def test_a_top_level_string_and_key_lookups_read_back(db):
    assert _read_back("plain") == "plain"
    event = Event.objects.create(kind="test.fields", message="m", data={"spec": {"dtype": "float16"}})
    assert Event.objects.values_list("data__spec", flat=True).get(pk=event.pk) == {"dtype": "float16"}
    assert Event.objects.values_list("data__spec__dtype", flat=True).get(pk=event.pk) == "float16"
