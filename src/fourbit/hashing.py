"""Canonical JSON and short content hashes: the keys of every cache in a study.

Changing the hash payload's layout or SCHEME_VERSION changes every id, which
invalidates cached results; say so in the commit's first line when you do.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

# Inside every hashed payload, so a change to how configs are canonicalised
# can never collide with ids made under the old rules.
SCHEME_VERSION = 1
HASH_CHARS = 10


def canonical_json(value: Any) -> str:
    """Sorted keys, fixed separators, plain scalars: one text per meaning."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def short_hash(kind: str, value: Any) -> str:
    payload = {"scheme": SCHEME_VERSION, "kind": kind, "value": value}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:HASH_CHARS]


def file_sha256(path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()
