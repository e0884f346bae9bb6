"""Which token block of a text request holds the tokens of each of its text blocks.

The router keys a text-only request on its text (:func:`natsched.wire.blocks.text_block_hashes`: blocks
of ``block_size * CHARS_PER_TOKEN`` UTF-8 bytes), while vLLM caches *token* blocks. The worker
bridges the two: text block *j* (bytes ``[0, (j+1)·W)`` of the prompt, a prefix) is attached to
the token block that contains the last token overlapping those bytes, so the text hash is
reported cached exactly while the tokens for that text prefix are cached.

If a text block's last token falls into the prompt's trailing *partial* token block (never
cached by vLLM), it is attached to the last full token block instead: the claim then
over-states the cached prefix by less than one token block, which keeps the published text
hashes equal to the router's chain for the whole prompt (a request that shares the text prefix
re-computes at most those few tokens).

Token boundaries come from the tokenizer's character offsets when it has them (fast HF
tokenizers); otherwise they are estimated proportionally (bytes -> tokens).

Pure module: no I/O.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate
from typing import Sequence

from natsched.wire.blocks import CHARS_PER_TOKEN

Offsets = Sequence[tuple[int, int]]


def _char_boundaries(text: str, byte_ends: Sequence[int]) -> list[int]:
    """For each byte length, the number of characters needed to cover that many UTF-8 bytes."""
    if text.isascii():
        return list(byte_ends)
    char_ends = list(accumulate(len(ch.encode("utf-8", "surrogatepass")) for ch in text))
    return [min(len(text), bisect_left(char_ends, e) + 1) for e in byte_ends]


def tokens_covering(text: str, n_tokens: int, offsets: Offsets | None, byte_ends: Sequence[int]) -> list[int]:
    """For each byte prefix length, how many leading tokens cover it (all tokens overlapping it)."""
    if n_tokens <= 0:
        return [0 for _ in byte_ends]
    if offsets is None or len(offsets) != n_tokens:
        total = max(1, len(text.encode("utf-8", "surrogatepass")))
        return [min(n_tokens, -(-e * n_tokens // total)) for e in byte_ends]
    chars = _char_boundaries(text, byte_ends)
    out: list[int] = []
    i = 0
    for c in chars:  # boundaries increase, so one forward pass serves them all
        # stop at the first token *with text* that starts at/after the boundary; special tokens
        # (empty spans, e.g. BOS) before it belong to the prefix
        while i < n_tokens and not (offsets[i][1] > offsets[i][0] and offsets[i][0] >= c):
            i += 1
        out.append(i)
    return out


def text_aliases(
    text: str,
    offsets: Offsets | None,
    n_tokens: int,
    text_hashes: Sequence[int],
    token_hashes: Sequence[int],
    block_size: int,
) -> list[tuple[int, int]]:
    """``(token_block_hash, text_block_hash)`` pairs for one text request.

    ``text_hashes`` is the router's chain for the request (full text blocks only);
    ``token_hashes`` the chain of its full token blocks (``n_tokens // block_size`` of them).
    """
    if not text_hashes or not token_hashes:
        return []
    width = block_size * CHARS_PER_TOKEN
    ends = [(j + 1) * width for j in range(len(text_hashes))]
    needed = tokens_covering(text, n_tokens, offsets, ends)
    last = len(token_hashes) - 1
    return [(token_hashes[min(max(t - 1, 0) // block_size, last)], txt) for t, txt in zip(needed, text_hashes)]
