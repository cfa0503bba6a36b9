"""`llmgw keys new|hash`: make API keys and the hashes routers store instead of them.

A router never holds a key, only "sha256:<hex SHA-256 of the key>", so a leaked
config or tenant record does not leak credentials. Keys are 256 random bits; a
plain SHA-256 is enough for them (a slow password hash would protect nothing
more and would cost every request).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import secrets
import sys

KEY_PREFIX = "sk-llmgw-"
HASH_PREFIX = "sha256:"
_HASH_RE = re.compile(r"sha256:[0-9a-f]{64}")


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def is_key_hash(value: str) -> bool:
    """True for "sha256:" followed by 64 lowercase hex digits."""
    return _HASH_RE.fullmatch(value) is not None


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    new = sub.add_parser("new", help="print a fresh API key and its hash")
    new.add_argument("-o", "--output", choices=["text", "json"], default="text")
    hsh = sub.add_parser("hash", help="print the hash of a key ('-' reads it from stdin)")
    hsh.add_argument("key", help="the API key, or '-' to read it from stdin (keeps it out of ps)")
    hsh.add_argument("-o", "--output", choices=["text", "json"], default="text")


def run(args: argparse.Namespace) -> int:
    if args.keys_command == "new":
        key = new_key()
        digest = hash_key(key)
        if args.output == "json":
            print(json.dumps({"key": key, "hash": digest}))
        else:
            print(f"key:  {key}")
            print(f"hash: {digest}")
        return 0
    key = sys.stdin.readline().strip() if args.key == "-" else args.key
    if not key:
        print("llmgw keys hash: the key is empty", file=sys.stderr)
        return 1
    digest = hash_key(key)
    print(json.dumps({"hash": digest}) if args.output == "json" else digest)
    return 0
