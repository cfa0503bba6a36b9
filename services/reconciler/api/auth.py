"""Who may call the operator API: bearer tokens, each with a name and a role.

The API shows the whole control plane, and two parts of it are more than an
on-call viewer needs: the folded catalog (tenant key hashes, upstream headers)
and the tenants (who pays for which band, at which quotas). So there are two
roles, `read` (what the cluster is doing and why) and `admin` (everything).

A token is stored as its `llmgw keys` hash ("sha256:<hex>"), never as itself:
the config or Secret that lists the tokens is no credential. Tokens are 256
random bits, so a plain SHA-256 is as strong as a slow hash here and costs
nothing per request.

With no token configured the API refuses every call and says how to configure
one: an unconfigured reconciler must not serve its catalog to whoever reaches
the port. `api_auth: none` turns the check off, for a loopback-only dev setup
(the config refuses it on any other address).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from llmgw import config, keys

READ = "read"
ADMIN = "admin"
ROLES = (READ, ADMIN)  # in rising order: each role may do what the ones before it may

AUTH_TOKENS = "tokens"
AUTH_NONE = "none"
AUTH_MODES = (AUTH_TOKENS, AUTH_NONE)

HOW_TO_CONFIGURE = (
    "make one with `llmgw keys new` and list its hash under api_tokens in the reconciler's "
    "config (or LLMGW_API_TOKENS); see docs/reconciler.md"
)


class ApiToken(config.ConfigStruct, kw_only=True):
    name: str  # who holds it (a person, a dashboard); appears in 403 messages
    role: str  # read | admin
    hash: str  # "sha256:<hex>", as `llmgw keys new` or `llmgw keys hash` prints it


@dataclass(frozen=True)
class Denied:
    """Why a request may not have what it asked for, as the API answers it."""

    status: int  # 401: no valid token; 403: a valid token whose role is too low
    code: str
    message: str


def config_problems(mode: str, tokens: list[ApiToken], listen_host: str) -> list[str]:
    """What is wrong with `api_auth` and `api_tokens`, each problem naming its key."""
    problems = []
    if mode not in AUTH_MODES:
        problems.append(f"api_auth = {mode!r}: must be one of {', '.join(AUTH_MODES)}")
    elif mode == AUTH_NONE and not is_loopback(listen_host):
        problems.append(
            f"api_auth = none: only for an admin_listen on loopback, not {listen_host!r} "
            "(anyone who reaches the port would read the catalog); configure api_tokens"
        )
    elif mode == AUTH_NONE and tokens:
        problems.append("api_auth = none: api_tokens would be ignored; remove one or the other")
    seen: set[str] = set()
    index_of_hash: dict[str, int] = {}
    for i, token in enumerate(tokens):
        key = f"api_tokens[{i}]"
        if not token.name.strip():
            problems.append(f"{key}.name: must not be empty")
        elif token.name in seen:
            problems.append(f"{key}.name = {token.name!r}: another token has this name")
        seen.add(token.name)
        if token.role not in ROLES:
            problems.append(f"{key}.role = {token.role!r}: must be one of {', '.join(ROLES)}")
        if not keys.is_key_hash(token.hash):
            problems.append(
                f"{key}.hash: must be 'sha256:' and 64 lowercase hex digits "
                "(`llmgw keys new` or `llmgw keys hash` prints one), not the token itself"
            )
        elif token.hash in index_of_hash:
            # Tokens are looked up by hash, so the last entry would win: a `read` token
            # listed again under `admin` would be an admin token.
            problems.append(f"{key}.hash: same as api_tokens[{index_of_hash[token.hash]}]")
        index_of_hash.setdefault(token.hash, i)
    return problems


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Authorizer:
    """Decides each request from its Authorization header and the role its endpoint needs."""

    def __init__(self, mode: str, tokens: list[ApiToken]):
        self.open = mode == AUTH_NONE
        self._by_hash = {token.hash: token for token in tokens}

    def check(self, authorization: str | None, needed: str) -> Denied | None:
        """None when the request may go on, else why not."""
        if self.open:
            return None
        if not self._by_hash:
            return Denied(
                401,
                "no_tokens_configured",
                f"this operator API needs a bearer token and none is configured: "
                f"{HOW_TO_CONFIGURE}",
            )
        if not authorization:
            return Denied(
                401,
                "missing_token",
                "the operator API needs a token: send 'Authorization: Bearer <token>'",
            )
        scheme, _, presented = authorization.strip().partition(" ")
        presented = presented.strip()
        if scheme.lower() != "bearer" or not presented:
            return Denied(401, "invalid_token", "the Authorization header must be 'Bearer <token>'")
        # Looked up by hash: what an attacker could time is a hash of their own guess.
        token = self._by_hash.get(keys.hash_key(presented))
        if token is None:
            return Denied(401, "invalid_token", "the token is not one this operator API knows")
        if ROLES.index(token.role) < ROLES.index(needed):
            return Denied(
                403,
                "insufficient_role",
                f"token {token.name!r} has role {token.role!r}; this needs {needed!r}",
            )
        return None
