"""What a request's tenant changes in the body sent upstream.

Two things, each only where it applies, so a request of a tenant without
either goes upstream byte for byte as the client sent it:

- a Responses API create gets a `request_id` minted for its tenant
  (ownership.py), which the engine takes as the stored response's id, and its
  `previous_response_id`, which would let the engine read that response, must
  belong to the same tenant: else 404, as for an id nobody has;
- a tenant whose prefix cache is kept apart (`cache_isolation`) gets its
  derived `cache_salt` on the kinds the engine salts (salting.py).

A client's salt in the router's namespace is refused for every tenant.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from llmgw.router.http.errors import RouterError
from llmgw.router.request import body as rq
from llmgw.router.request import kinds, ownership, salting

if TYPE_CHECKING:
    from llmgw.router.admission.seam import Caller

_NULL = b"null"


def not_found(param: str = "id") -> RouterError:
    """The answer for a stored response the caller does not own, the same as for one
    that does not exist."""
    return RouterError(404, "response_not_found", "no stored response with that id", param=param)


def bind(
    req: rq.Parsed,
    caller: Caller,
    headers: dict[bytes, bytes],
    owns: Callable[[bytes, str], bool],
) -> None:
    """Rewrite `req.body` (and `req.cache_salt`) for a request of a declared tenant;
    `owns(response_id, owner)` says whether a stored response is that tenant's."""
    owner = caller.owner
    assert owner is not None  # callers without an owner (no tenants) are not bound
    salting.check_client_salt(req.cache_salt)
    api = req.api
    scope = caller.cache_scope(headers) if api.salted else None
    if api is not kinds.RESPONSES and scope is None:
        return
    top = rq.top_keys(req.body)
    values: dict[str, object] = {}
    if api is kinds.RESPONSES:
        previous = bytes(top.get("previous_response_id", _NULL))
        if previous != _NULL:
            previous_id = rq.string_of(previous)
            if previous_id is None:
                raise RouterError(
                    400,
                    "invalid_request",
                    "previous_response_id: expected a string",
                    param="previous_response_id",
                )
            if not owns(previous_id.encode(), owner):
                raise not_found("previous_response_id")
        values["request_id"] = ownership.mint(owner).decode()
    if scope is not None:
        client = bytes(top.get("cache_salt", _NULL))
        req.cache_salt = salting.salt(scope, b"" if client == _NULL else client)
        values["cache_salt"] = req.cache_salt
    req.body = rq.with_keys(top, **values)
