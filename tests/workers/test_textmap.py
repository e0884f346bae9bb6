"""Text-block -> token-block attachment for text prompts (pure; real tokenizers in test_vllm_text)."""

from __future__ import annotations

from natsched.wire.blocks import CHARS_PER_TOKEN, request_block_hashes, root_hash, token_block_hashes
from natsched.wire.schema import Request
from natsched.workers.textmap import text_aliases, tokens_covering


def test_tokens_covering_uses_offsets_and_keeps_leading_special_tokens():
    offsets = [(0, 0), (0, 3), (3, 5), (5, 8), (0, 0)]  # BOS, three words, EOS
    assert tokens_covering("abcdefgh", 5, offsets, [1, 3, 4, 8]) == [2, 2, 3, 5]


def test_tokens_covering_counts_utf8_bytes_not_characters():
    # 'ü' is 2 bytes: a boundary inside it needs the token that holds it
    assert tokens_covering("ab\u00fccd", 4, [(0, 0), (0, 2), (2, 3), (3, 5)], [2, 3, 4, 6]) == [2, 3, 3, 4]


def test_tokens_covering_without_offsets_is_proportional():
    assert tokens_covering("x" * 100, 25, None, [40, 100]) == [10, 25]


def _one_char_per_token(text: str):
    ids = [1] + [ord(c) % 1000 for c in text]
    offsets = [(0, 0)] + [(i, i + 1) for i in range(len(text))]
    return ids, offsets


def test_every_text_hash_is_attached_and_none_beyond_the_full_token_blocks():
    bs = 8
    text = "y" * (bs * CHARS_PER_TOKEN * 3 + 20)  # 3 full text blocks (of 32 chars), 14 token blocks
    req = Request(id="r", tenant="t", cls="online", model="m", prompt=text)
    text_hashes = request_block_hashes(req, bs)
    ids, offsets = _one_char_per_token(text)
    tok_hashes = token_block_hashes(ids, bs, root_hash("m"))
    pairs = text_aliases(text, offsets, len(ids), text_hashes, tok_hashes, bs)
    assert [t for _, t in pairs] == text_hashes
    # text block j covers chars [0, 32(j+1)) = tokens [0, 1 + 32(j+1)) (BOS first)
    assert [tok_hashes.index(k) for k, _ in pairs] == [4, 8, 12]


def test_a_text_block_that_ends_in_the_partial_token_block_goes_to_the_last_full_one():
    bs = 8
    text = "z" * (bs * CHARS_PER_TOKEN)  # exactly one text block; tokens: BOS + 32 = 33 -> 4 full blocks + 1
    ids, offsets = _one_char_per_token(text)
    tok_hashes = token_block_hashes(ids, bs, root_hash("m"))
    pairs = text_aliases(text, offsets, len(ids), [12345], tok_hashes, bs)
    assert pairs == [(tok_hashes[-1], 12345)]


def test_no_full_token_block_no_attachment():
    assert text_aliases("a" * 200, None, 5, [1, 2], [], 32) == []
