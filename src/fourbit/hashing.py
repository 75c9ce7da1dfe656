"""Canonical JSON and short content hashes: the keys of every cache in a study.

Changing the hash payload's layout or SCHEME_VERSION changes every id, which
invalidates cached results; say so in the commit's first line when you do.
"""

from __future__ import annotations

import hashlib
import json
import re
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


SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def model_weights_sha256(manifest_path) -> str:
    """The one sha256 of a model's weights that every downstream record carries.

    Read from a source folder's fourbit-source.json (fourbit.steps.prepare.fetch_model writes
    it for every model source), whose ``weights_sha256`` maps each weight file to its
    sha256. One file (the builtin model's model.safetensors): that file's sha256, as
    ``sha256sum model.safetensors`` prints it. Several (a sharded checkpoint): the
    sha256 of the lines sha256sum prints for them, sorted by name, i.e. what
    ``LC_ALL=C sha256sum *.safetensors | sha256sum`` prints in the folder.
    """
    with open(manifest_path, encoding="utf-8") as handle:
        files = json.load(handle).get("weights_sha256")
    if not files or not isinstance(files, dict):
        raise ValueError(f"{manifest_path}: no weights_sha256 per weight file")
    for name, digest in files.items():
        require_sha256(digest, f"{manifest_path}: weights_sha256[{name!r}]")
    if len(files) == 1:
        return next(iter(files.values()))
    listing = "".join(f"{files[name]}  {name}\n" for name in sorted(files))
    return hashlib.sha256(listing.encode()).hexdigest()


def require_sha256(value: Any, what: str = "model_weights_sha256") -> str:
    """``value`` if it is a sha256 in lowercase hex; else ValueError naming ``what``."""
    if not isinstance(value, str) or not SHA256_HEX.fullmatch(value):
        raise ValueError(f"{what} must be a sha256 in lowercase hex (64 characters), not {value!r}")
    return value
