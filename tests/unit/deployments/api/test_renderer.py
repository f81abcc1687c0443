"""The API's JSON renderer writes what DRF's own wrote."""

from __future__ import annotations

import datetime
import decimal
import json
import uuid

import orjson
from django.utils.translation import gettext_lazy
from rest_framework.exceptions import ErrorDetail
from rest_framework.renderers import JSONRenderer as DRFRenderer
from rest_framework.utils.serializer_helpers import ReturnDict, ReturnList

from core.api.renderers import JSONRenderer

WHEN = datetime.datetime(2026, 11, 24, 6, 30, 1, 123456, tzinfo=datetime.UTC)

PAYLOADS = [
    {"results": [{"id": 1, "at": WHEN, "spec": {"dtype": "float16", "tp": [0, 1]}, "hint": None}], "next": None},
    {"day": WHEN.date(), "time": WHEN.time(), "naive": WHEN.replace(tzinfo=None), "span": datetime.timedelta(1.5)},
    {"price": decimal.Decimal("1.25"), "id": uuid.UUID(int=7), "lazy": gettext_lazy("Not found.")},
    {"errors": {"name": [ErrorDetail("must be unique", code="unique")]}, "ok": True, "ratio": 0.5},
    ReturnDict({"a": ReturnList([1, 2], serializer=None)}, serializer=None),
    {"text": 'line\u2028separator\u2029paragraph, émoji 🚀, quote " and \\ backslash'},
    [],
    "plain",
]


def test_it_writes_the_same_bytes_as_drfs_renderer():
    for payload in PAYLOADS:
        assert JSONRenderer().render(payload) == DRFRenderer().render(payload), payload


def test_what_orjson_refuses_is_left_to_drf():
    for payload in ({1: "integer key"}, {"big": 2**70}):
        assert JSONRenderer().render(payload) == DRFRenderer().render(payload)


def test_an_indented_rendering_is_drfs():
    media = "application/json; indent=2"
    for payload in PAYLOADS:
        assert JSONRenderer().render(payload, media) == DRFRenderer().render(payload, media), payload
    assert b"\n" in JSONRenderer().render({"a": [1]}, media)


def test_stored_json_is_written_as_stored_and_indented_as_parsed():
    # What a StoredJSON column reads (core.fields): the database's own text, digits beyond 64 bits kept.
    stored = '{"tp": [0, 1], "seed": 123456789012345678901234}'
    payload = {"id": 1, "spec": orjson.Fragment(stored), "none": None}
    assert JSONRenderer().render(payload) == b'{"id":1,"spec":' + stored.encode() + b',"none":null}'
    media = "application/json; indent=2"
    expected = DRFRenderer().render({"id": 1, "spec": json.loads(stored), "none": None}, media)
    assert JSONRenderer().render(payload, media) == expected


def test_a_float_that_is_not_a_number_is_null():
    assert json.loads(JSONRenderer().render({"value": float("nan")})) == {"value": None}
