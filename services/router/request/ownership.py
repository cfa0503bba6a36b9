"""Which tenant a stored response belongs to, told from its id alone.

Routers are stateless and share nothing, yet a stored response (`store: true`)
may be fetched, deleted or cancelled through any router, any worker. So the
router that relays a Responses API create names the response itself: it sets
the body's `request_id`, which vLLM (and the simulator) take as the response's
id, to a fresh nonce followed by a tag, a hash of the owning tenant and the
nonce. Any router can then check, from the id and the caller's tenant alone,
whether the caller owns it.

No secret is needed for that check to hold: the tag binds the id to a tenant,
and the engine stores the response under the whole id. Another tenant who
learns the id gets a tag that does not match its own name; one who builds an
id tagged for itself names a response that does not exist, since only a router
chooses `request_id` and it always chooses for the caller. What the tag does
not hide is the tenant's name from someone who holds the id and guesses names.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

PREFIX = b"resp_"
NONCE_HEX = 24  # 96 random bits: ids never repeat
TAG_HEX = 32  # 128 bits of the tenant's hash


def _tag(owner: str, nonce: bytes) -> bytes:
    digest = hashlib.sha256(b"llmgw stored response\0" + owner.encode() + b"\0" + nonce)
    return digest.hexdigest()[:TAG_HEX].encode()


def mint(owner: str) -> bytes:
    """A new response id that only `owner` can use."""
    nonce = secrets.token_hex(NONCE_HEX // 2).encode()
    return PREFIX + nonce + _tag(owner, nonce)


def minted_for(owner: str, response_id: bytes) -> bool:
    """Whether a router minted `response_id` for `owner`."""
    if len(response_id) != len(PREFIX) + NONCE_HEX + TAG_HEX or not response_id.startswith(PREFIX):
        return False
    nonce = response_id[len(PREFIX) : len(PREFIX) + NONCE_HEX]
    return hmac.compare_digest(response_id[len(PREFIX) + NONCE_HEX :], _tag(owner, nonce))
