"""Prefix identity: chained block hashes that every router replica and worker agree on.

A prompt is cut into fixed-size blocks; block *i*'s hash covers its own content and the hash
of block *i-1*, so equal hashes mean equal *prefixes*, as in vLLM's prefix cache. The seed is
fixed (not per process, unlike vLLM's own hashes) so any process computes the same chain.

- Token-id prompts hash their token ids, ``block_size`` tokens per block.
- Text-only prompts hash a *stable route key*: the root covers the model and the
  knowledge-base version; the system prompt and then the prompt text follow in fixed-size
  character blocks (``block_size * CHARS_PER_TOKEN`` chars). User and session ids never enter.
- Only full blocks are hashed (a partial block cannot be shared), matching vLLM.

Pure module: no I/O.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from typing import Sequence

from natsched.wire.ids import BlockHash
from natsched.wire.schema import Request

SEED = b"natsched/prefix/v1"
CHARS_PER_TOKEN = 4  # text-length estimate of tokens when no tokenizer is at hand
_MASK = (1 << 63) - 1  # keep hashes inside msgpack's signed int64 on every reader


def _h(parent: int, payload: bytes) -> BlockHash:
    digest = hashlib.blake2b(payload, digest_size=8, key=parent.to_bytes(8, "little")).digest()
    return BlockHash(int.from_bytes(digest, "little") & _MASK)


def root_hash(model: str, kb_version: str | None = None) -> BlockHash:
    """The parent of a prompt's first block: requests of different models never share."""
    return _h(0, SEED + b"|" + model.encode() + b"|" + (kb_version or "").encode())


def _token_bytes(tokens: Sequence[int]) -> bytes:
    arr = array("I", tokens)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def token_block_hashes(tokens: Sequence[int], block_size: int, parent: int) -> list[BlockHash]:
    """Chained hashes of every full ``block_size``-token block of ``tokens``."""
    out: list[BlockHash] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = _h(parent, _token_bytes(tokens[start : start + block_size]))
        out.append(parent)
    return out


def text_block_hashes(text: str, block_size: int, parent: int) -> list[BlockHash]:
    """Chained hashes of every full block of ``block_size * CHARS_PER_TOKEN`` characters."""
    width = block_size * CHARS_PER_TOKEN
    data = text.encode("utf-8", "surrogatepass")
    out: list[BlockHash] = []
    for start in range(0, len(data) - width + 1, width):
        parent = _h(parent, data[start : start + width])
        out.append(parent)
    return out


def estimate_prompt_tokens(request: Request) -> int:
    """Prompt length in tokens: exact for token ids, ``len/CHARS_PER_TOKEN`` for text."""
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids)
    text_len = len((request.system_prompt or "").encode()) + len((request.prompt or "").encode())
    return max(1, -(-text_len // CHARS_PER_TOKEN))


def estimate_prefill_tokens(request: Request) -> int:
    """What the engine prefills: the prompt, and a migrated stream's output so far after it
    (``resume_token_ids``, which its ``max_tokens`` already counts)."""
    return estimate_prompt_tokens(request) + len(request.resume_token_ids or ())


def request_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """The prefix chain of a request, as the router and the workers compute it."""
    if request.prompt_token_ids is not None:
        return token_block_hashes(request.prompt_token_ids, block_size, root_hash(request.model))
    text = (request.system_prompt or "") + (request.prompt or "")
    return text_block_hashes(text, block_size, root_hash(request.model, request.kb_version))
