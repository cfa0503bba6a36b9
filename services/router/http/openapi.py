"""The router's own OpenAPI document, served at GET /openapi.json on the public listener.

The request schema is generated from the struct the router reads requests
with (`llmgw.router.request.validation.RoutedFields`), so the document states exactly
what a request is held to by the router; every other field passes through to
the engine, which judges it. Responses are described as the router relays them: the
engine's OpenAI-shaped answer (JSON, or server-sent events when streaming),
or the router's own error body.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from llmgw import __version__
from llmgw.router.request import kinds
from llmgw.router.request import validation as v

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
    "400": "Malformed JSON, `model` or `stream` of the wrong type, or a limit passed "
    f"(nesting deeper than {v.MAX_DEPTH} levels, a model name over {v.MAX_MODEL_NAME} "
    "characters); the engine's own 400s are relayed as it sent them",
    "401": "Missing or unknown API key (when tenants are configured)",
    "404": "Unknown model, or a model that does not serve this API kind",
    "408": "The request body did not arrive in time, or every engine answered 408",
    "413": "Body larger than max_body_bytes",
    "429": "A tenant quota or the band's queue is full, or every engine answered 429; "
    "Retry-After says when to retry",
    "431": "Request line and headers larger than the router accepts",
    "502": "Every endpoint failed before answering (upstream down or erroring)",
    "503": "No ready endpoint serves the model, or admission could not place it in time",
    "504": "A deadline passed before the engine answered",
}

_SUMMARIES = {
    "chat": "Chat completion",
    "completions": "Text completion",
    "embeddings": "Embeddings",
    "responses": "Responses API",
    "transcriptions": "Audio transcription or translation (multipart form)",
    "tokenize": "Tokenize (vLLM)",
    "detokenize": "Detokenize (vLLM)",
    "rerank": "Rerank (vLLM)",
    "score": "Score (vLLM)",
    "pooling": "Pooling (vLLM)",
    "classify": "Classify (vLLM)",
}


def _request_schema() -> tuple[dict[str, Any], dict[str, Any]]:
    """The routed fields as one object schema, and the shared components."""
    fields = msgspec.structs.fields(v.RoutedFields)
    schemas, components = msgspec.json.schema_components(
        [bool | None if f.name == "stream" else Any for f in fields], ref_template=_REF
    )
    props = {f.encode_name: schema for f, schema in zip(fields, schemas, strict=True)}
    props["model"] = {
        "type": "string",
        "minLength": 1,
        "maxLength": v.MAX_MODEL_NAME,
        "description": "a model name or alias; no control characters",
    }
    obj = {
        "type": "object",
        "required": ["model"],
        "properties": props,
        "additionalProperties": True,  # passed through to the engine, which judges them
        "description": "What the router reads of a request; the rest goes to the engine as sent.",
    }
    return obj, components


def document() -> dict[str, Any]:
    obj, components = _request_schema()
    components = {**components, "RoutedRequest": obj, "Error": _ERROR}
    errors = {
        code: {
            "description": text,
            "content": {"application/json": {"schema": {"$ref": _REF.format(name="Error")}}},
        }
        for code, text in _ERRORS.items()
    }
    paths: dict[str, Any] = {}
    for kind in kinds.ALL:
        answer: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
        if kind.stream is not None:
            answer["text/event-stream"] = {"schema": {"type": "string"}}
        if kind.multipart:
            content = {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["model", "file"],
                        "properties": {
                            "model": {"type": "string"},
                            "file": {"type": "string", "format": "binary"},
                        },
                    }
                }
            }
        else:
            content = {"application/json": {"schema": {"$ref": _REF.format(name="RoutedRequest")}}}
        for path in kind.paths:
            paths[path] = {
                "post": {
                    "summary": _SUMMARIES[kind.name],
                    "operationId": kind.name + path.replace("/", "_").replace("-", "_"),
                    "requestBody": {"required": True, "content": content},
                    "responses": {
                        "200": {
                            "description": "The engine's answer, relayed"
                            + (
                                " (server-sent events when stream is true)"
                                if kind.stream is not None
                                else ""
                            ),
                            "content": answer,
                        },
                        **errors,
                    },
                }
            }
    paths["/v1/responses/{id}"] = {
        method: {
            "summary": f"{method.upper()} a stored response, at the engine that made it",
            "operationId": f"{method}Response",
            "parameters": [
                {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
            ],
            "responses": {"200": {"description": "The engine's answer, relayed"}, **errors},
        }
        for method in ("get", "delete")
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
                                                "max_model_len": {"type": "integer"},
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
    paths.update(_probes())
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


def _probes() -> dict[str, Any]:
    """vLLM's probes (probes.py): no key asked."""
    ready = {
        "200": {"description": "The router can route (empty body)"},
        "503": {"description": "The router cannot route now (empty body)"},
    }
    health = {"summary": "Whether the router can route, as vLLM's /health", "security": []}
    return {
        "/health": {"get": {**health, "operationId": "health", "responses": ready}},
        "/ping": {
            method: {**health, "operationId": f"{method}Ping", "responses": ready}
            for method in ("get", "post")
        },
        "/version": {
            "get": {
                "summary": "llmgw's version, as vLLM's /version",
                "operationId": "version",
                "security": [],
                "responses": {
                    "200": {
                        "description": "The version",
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["version"],
                                    "properties": {"version": {"type": "string"}},
                                }
                            }
                        },
                    }
                },
            }
        },
    }


_BODY = msgspec.json.encode(document())


async def endpoint(request: Request) -> Response:  # noqa: ARG001
    return Response(_BODY, media_type="application/json")
