"""SHA-256 digests: of a checkpoint's contents (saved in the file, checked on reading) and of an export's weights.

torch's zip reader does not check its records' CRCs, so a flipped byte in a tensor would otherwise load silently.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any, Mapping

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from ltcx.errors import ANOTHER_VERSION, LtcxError

__all__ = ["DIGEST_KEY", "DIGEST_VERSION", "content_digest", "with_digest", "check_digest", "file_sha256"]

# The digest of a checkpoint's contents, saved in the file under this key: {"sha256": hex, "version": 1}.
DIGEST_KEY, DIGEST_VERSION = "ltcx_digest", 1


def content_digest(obj: Any) -> str:
    """SHA-256 of ``obj`` walked canonically: each container's type and length, then its items in order (dict keys
    in insertion order, which pickle keeps; sets sorted); each tensor's dtype, shape and raw bytes (contiguous, as
    uint8, so bf16 works); other values by type and ``repr`` (exact for floats, nan and -0.0 included)."""
    sha = hashlib.sha256()

    def put(tag: str, data: bytes | memoryview = b"") -> None:
        data = memoryview(data)
        sha.update(f"{tag}:{data.nbytes}:".encode())
        sha.update(data)

    def walk(value: Any) -> None:
        if torch.is_tensor(value):
            tensor = value.detach().cpu().contiguous().reshape(-1)
            put("tensor", f"{tensor.dtype}{list(value.shape)}".encode())
            put("data", tensor.view(torch.uint8).numpy())
        elif isinstance(value, Mapping):
            put(type(value).__name__, str(len(value)).encode())
            for key, item in value.items():
                walk(key)
                walk(item)
        elif isinstance(value, (list, tuple, set, frozenset)):
            items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
            put(type(value).__name__, str(len(value)).encode())
            for item in items:
                walk(item)
        elif isinstance(value, str):
            put("str", value.encode("utf-8", "surrogatepass"))
        elif isinstance(value, (bytes, bytearray)):
            put(type(value).__name__, value)
        else:
            put(type(value).__name__, repr(value).encode())

    walk(obj)
    return sha.hexdigest()


def with_digest(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` (not changed) plus its digest, under the last key."""
    contents = {k: v for k, v in checkpoint.items() if k != DIGEST_KEY}
    return {**contents, DIGEST_KEY: {"sha256": content_digest(contents), "version": DIGEST_VERSION}}


def check_digest(name: str, checkpoint: dict[str, Any]) -> None:
    """Take the digest out of ``checkpoint`` and check it; a file without one (torch.save, an earlier ltcx) is one
    notice line."""
    saved = checkpoint.pop(DIGEST_KEY, None)
    if saved is None:
        if getattr(rank_zero_only, "rank", 0) == 0:
            print(f"ltcx: checkpoint '{name}' has no SHA-256 digest (written by torch.save or an earlier ltcx), so "
                  "it could not be checked for damage", file=sys.stderr)
        return
    if not isinstance(saved, dict) or saved.get("version") != DIGEST_VERSION:
        raise LtcxError(f"checkpoint '{name}' has a digest of another version of ltcx ({saved!r:.80}): "
                        f"{ANOTHER_VERSION}")
    if saved.get("sha256") != content_digest(checkpoint):
        raise LtcxError(f"checkpoint '{name}' is damaged: its contents do not match the SHA-256 digest saved with it "
                        "(bytes changed on disk or in transfer); use another checkpoint")


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes (an export's ``model.safetensors``)."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            sha.update(block)
    return sha.hexdigest()
