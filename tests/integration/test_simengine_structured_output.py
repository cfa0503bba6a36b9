"""Structured output through the openai SDK against a real `llmgw sim-engine` process:
`response_format` json_object and json_schema (and the Responses API's `text.format`),
answered, as vLLM's guided decoding answers, with JSON that parses and matches the schema,
split across deltas when streamed and truncated with finish_reason "length" by max_tokens."""

from __future__ import annotations

import json
from enum import Enum

import jsonschema  # installed with the dev extras (litellm needs it)
import openai
import pydantic
import pytest

from llmgw.dev.simkit import SimProcess, start_sim

MODEL = "sim-model"
USER = [{"role": "user", "content": "Describe a city."}]


class Size(str, Enum):
    small = "small"
    large = "large"


class District(pydantic.BaseModel):
    name: str
    population: int = pydantic.Field(ge=1000)


class City(pydantic.BaseModel):
    name: str
    country: str | None
    size: Size
    area_km2: float = pydantic.Field(gt=0, lt=10_000)
    capital: bool
    districts: list[District] = pydantic.Field(min_length=2)


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 3, "maxLength": 20},
        "rank": {"type": "integer", "minimum": 1, "maximum": 10},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 3},
        "kind": {"enum": ["port", "inland"]},
        "note": {"type": ["string", "null"]},
    },
    "required": ["city", "rank", "tags", "kind"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def sim() -> SimProcess:
    with start_sim(max_num_seqs=8, itl_ms=1, max_model_len=4096) as s:
        yield s


@pytest.fixture
def client(sim: SimProcess) -> openai.OpenAI:
    with openai.OpenAI(base_url=sim.base_url, api_key="unused", max_retries=0, timeout=10) as c:
        yield c


def test_json_object_answers_a_json_object(client: openai.OpenAI):
    answer = client.chat.completions.create(
        model=MODEL, messages=USER, response_format={"type": "json_object"}
    )
    assert answer.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_json_schema_answers_json_that_validates_streamed_or_not(client: openai.OpenAI):
    whole = client.chat.completions.create(model=MODEL, messages=USER, response_format=JSON_SCHEMA)
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert whole.choices[0].finish_reason == "stop"

    deltas = [
        chunk.choices[0].delta.content
        for chunk in client.chat.completions.create(
            model=MODEL, messages=USER, response_format=JSON_SCHEMA, stream=True
        )
        if chunk.choices and chunk.choices[0].delta.content
    ]
    assert len(deltas) > 5  # split across deltas, a few bytes a token
    assert "".join(deltas) == text


def test_completions_take_response_format_too(client: openai.OpenAI):
    answer = client.completions.create(
        model=MODEL, prompt="A city:", max_tokens=500, extra_body={"response_format": JSON_SCHEMA}
    )
    jsonschema.validate(json.loads(answer.choices[0].text), SCHEMA)
    assert answer.choices[0].finish_reason == "stop"
    streamed = "".join(
        chunk.choices[0].text
        for chunk in client.completions.create(
            model=MODEL,
            prompt="A city:",
            max_tokens=500,
            stream=True,
            extra_body={"response_format": {"type": "json_object"}},
        )
        if chunk.choices
    )
    assert isinstance(json.loads(streamed), dict)


def test_max_tokens_truncates_the_json_with_finish_reason_length(client: openai.OpenAI):
    answer = client.chat.completions.create(
        model=MODEL, messages=USER, response_format=JSON_SCHEMA, max_tokens=4
    )
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(answer.choices[0].message.content)


def test_the_sdks_parse_fills_a_pydantic_model(client: openai.OpenAI):
    parsed = client.beta.chat.completions.parse(model=MODEL, messages=USER, response_format=City)
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and len(city.districts) >= 2
    assert all(d.population >= 1000 for d in city.districts)
    with pytest.raises(openai.LengthFinishReasonError):
        client.beta.chat.completions.parse(
            model=MODEL, messages=USER, response_format=City, max_tokens=3
        )


def test_a_schema_the_simulator_cannot_answer_is_a_400_naming_response_format(
    client: openai.OpenAI,
):
    for fmt in (
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "^a+$"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}},
        {"type": "json_schema"},
        {"type": "grammar"},
    ):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=USER, response_format=fmt)
        assert err.value.body["param"].startswith("response_format")
        assert err.value.body["type"] == "invalid_request_error"


def test_responses_text_format_shapes_the_output_text(client: openai.OpenAI):
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}}
    resp = client.responses.create(model=MODEL, input="Describe a city.", text=fmt)
    jsonschema.validate(json.loads(resp.output_text), SCHEMA)
    parsed = client.responses.parse(model=MODEL, input="Describe a city.", text_format=City)
    assert isinstance(parsed.output_parsed, City)
    events = client.responses.create(
        model=MODEL, input="x", text={"format": {"type": "json_object"}}, stream=True
    )
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert isinstance(json.loads(text), dict)
