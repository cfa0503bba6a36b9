"""The router's own OpenAPI document, served at GET /openapi.json on the public listener.

The request schemas are generated from the structs the router validates with
(`llmgw.router.validation`), so the document states exactly the types, ranges
and limits a request is held to; fields it does not list pass through to the
engine untouched. Responses are described as the router relays them: the
engine's OpenAI-shaped answer (JSON, or server-sent events when streaming),
or the router's own error body.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from llmgw import __version__
from llmgw.router import validation as v

_REF = "#/components/schemas/{name}"

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "string", "description": "also in the x-llmgw-reason header"},
            },
        }
    },
}

_ERRORS = {
    "400": "Malformed JSON, a field of the wrong type or out of range, or a limit passed "
    f"(nesting deeper than {v.MAX_DEPTH} levels, more than {v.MAX_MESSAGES} messages, "
    f"a model name over {v.MAX_MODEL_NAME} characters)",
    "401": "Missing or unknown API key (when tenants are configured)",
    "404": "Unknown model",
    "413": "Body larger than max_body_bytes",
    "429": "A tenant quota or the band's queue is full; Retry-After says when to retry",
    "431": "Request line and headers larger than the router accepts",
    "502": "Every endpoint failed before answering (upstream down or erroring)",
    "503": "No ready endpoint serves the model, or admission could not place it in time",
    "504": "A deadline passed before the engine answered",
}

# (path, request struct, the raw field, its schema's type, summary)
_OPERATIONS = [
    ("/v1/chat/completions", v.ChatRequest, "messages", v.Messages, "Chat completion"),
    ("/v1/completions", v.CompletionRequest, "prompt", v.Prompt, "Text completion"),
    ("/v1/embeddings", v.EmbeddingRequest, "input", v.Prompt, "Embeddings"),
]


def _request_schemas() -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Each request struct as an object schema, and the shared components."""
    fields: list[tuple[str, str, Any]] = []  # (struct name, field name, type)
    for _, struct, raw_field, raw_type, _ in _OPERATIONS:
        for f in msgspec.structs.fields(struct):
            fields.append(
                (struct.__name__, f.encode_name, raw_type if f.name == raw_field else f.type)
            )
    schemas, components = msgspec.json.schema_components(
        [t for _, _, t in fields], ref_template=_REF
    )
    objects: dict[str, dict[str, Any]] = {}
    for (struct, name, _), schema in zip(fields, schemas, strict=True):
        objects.setdefault(struct, {"type": "object", "properties": {}})["properties"][name] = (
            schema
        )
    for _, struct, raw_field, _, summary in _OPERATIONS:
        obj = objects[struct.__name__]
        obj["required"] = ["model", raw_field]
        obj["additionalProperties"] = True  # passed through to the engine
        obj["properties"]["model"] = {
            "type": "string",
            "minLength": 1,
            "maxLength": v.MAX_MODEL_NAME,
            "description": "a model name or alias; no control characters",
        }
        obj["description"] = f"{summary} request as the router checks it."
    return objects, components


def document() -> dict[str, Any]:
    objects, components = _request_schemas()
    components = {**components, **objects, "Error": _ERROR}
    errors = {
        code: {
            "description": text,
            "content": {"application/json": {"schema": {"$ref": _REF.format(name="Error")}}},
        }
        for code, text in _ERRORS.items()
    }
    paths: dict[str, Any] = {}
    for path, struct, _, _, summary in _OPERATIONS:
        streams = struct is not v.EmbeddingRequest
        answer: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
        if streams:
            answer["text/event-stream"] = {"schema": {"type": "string"}}
        paths[path] = {
            "post": {
                "summary": summary,
                "operationId": struct.__name__[0].lower() + struct.__name__[1:],
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": _REF.format(name=struct.__name__)}}
                    },
                },
                "responses": {
                    "200": {
                        "description": "The engine's answer, relayed"
                        + (" (server-sent events when stream is true)" if streams else ""),
                        "content": answer,
                    },
                    **errors,
                },
            }
        }
    paths["/v1/models"] = {
        "get": {
            "summary": "Models and aliases this router serves",
            "operationId": "listModels",
            "responses": {
                "200": {
                    "description": "The model list",
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": ["object", "data"],
                                "properties": {
                                    "object": {"const": "list"},
                                    "data": {
                                        "type": "array",
                                        "items": {
                                            "type": "object",
                                            "required": ["id", "object"],
                                            "properties": {
                                                "id": {"type": "string"},
                                                "object": {"const": "model"},
                                                "created": {"type": "integer"},
                                                "owned_by": {"type": "string"},
                                                "root": {"type": "string"},
                                            },
                                        },
                                    },
                                },
                            }
                        }
                    },
                },
                "401": errors["401"],
            },
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "llmgw router",
            "version": __version__,
            "description": "OpenAI-compatible endpoints in front of the llmgw fleet.",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"apiKey": []}, {}],
    }


_BODY = msgspec.json.encode(document())


async def endpoint(request: Request) -> Response:  # noqa: ARG001
    return Response(_BODY, media_type="application/json")
