"""The cache salt a request carries upstream when its tenant's prefix cache is kept apart.

An engine with prefix caching answers a prompt whose beginning it has cached
sooner than one it has not, so a tenant who times its requests can tell
whether another tenant sent a prompt that starts the same way. vLLM's
`cache_salt` keys a request's KV blocks: requests with different salts never
share a cached block. A tenant declared with `cache_isolation: tenant` (or
`key`) gets a salt derived from its name (and API key) on every request of a
kind the engine salts, so its cached prefixes are its own; a salt the client
sent is hashed in with it, so the client keeps its own subdivisions but cannot
reach another's.

The derived salts need no secret: they all begin with RESERVED, and the router
refuses a client-supplied salt that does (`check_client_salt`), so no tenant can
send another's salt as is, whatever it can compute.
"""

from __future__ import annotations

import base64
import hashlib

from llmgw.router.http.errors import RouterError

RESERVED = "llmgw-"


def salt(scope: bytes, client: bytes) -> str:
    """The salt for a tenant (or key) `scope` and the raw JSON of the client's own
    salt (b"" for none): 50 URL-safe characters, within vLLM's 128 and without the
    characters it refuses."""
    digest = hashlib.sha256(b"llmgw cache salt\0" + scope + b"\0" + client).digest()
    return RESERVED + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def check_client_salt(client_salt: str | None) -> None:
    """A 400 for a client salt in the router's namespace."""
    if client_salt is not None and client_salt.startswith(RESERVED):
        raise RouterError(
            400,
            "invalid_request",
            f"cache_salt: values beginning with {RESERVED!r} are reserved for the router",
            param="cache_salt",
        )
