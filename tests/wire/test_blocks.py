from natsched.wire.blocks import estimate_prompt_tokens, request_block_hashes, root_hash, text_block_hashes, token_block_hashes
from tests.factories.core import make_request


def test_only_full_blocks_are_hashed():
    assert len(token_block_hashes(list(range(95)), 32, 0)) == 2
    assert len(token_block_hashes(list(range(96)), 32, 0)) == 3
    assert token_block_hashes(list(range(31)), 32, 0) == []


def test_chain_equal_prefix_equal_hashes_then_diverge():
    a = token_block_hashes(list(range(128)), 32, root_hash("m"))
    b = token_block_hashes(list(range(64)) + [7] * 64, 32, root_hash("m"))
    assert a[:2] == b[:2] and a[2] != b[2]


def test_same_block_content_at_other_position_differs():
    block = [5] * 32
    chain = token_block_hashes(block * 2, 32, root_hash("m"))
    assert chain[0] != chain[1]  # the parent is part of the hash


def test_model_separates_chains():
    toks = list(range(64))
    assert token_block_hashes(toks, 32, root_hash("a")) != token_block_hashes(toks, 32, root_hash("b"))


def test_hashes_are_pinned():
    # pinned values: a change to the hash function silently breaks agreement between a new
    # router and workers still running the old code, so it must be a deliberate wire change
    assert root_hash("default") == 6021777924945706813
    assert token_block_hashes(list(range(32)), 32, root_hash("default")) == [804433981000028054]


def test_text_route_key_uses_system_prompt_and_kb_version():
    sys_prompt = "You are a helpful assistant. " * 20
    a = make_request("question one?", system_prompt=sys_prompt, kb_version="kb1")
    b = make_request("another question", system_prompt=sys_prompt, kb_version="kb1")
    c = make_request("question one?", system_prompt=sys_prompt, kb_version="kb2")
    ha, hb, hc = (request_block_hashes(r, 32) for r in (a, b, c))
    shared = len(sys_prompt.encode()) // (32 * 4)
    assert ha[:shared] == hb[:shared] and shared >= 4
    assert not set(ha) & set(hc)


def test_user_ids_do_not_enter_the_key():
    a = make_request("x" * 400, tenant="alice", id="ra")
    b = make_request("x" * 400, tenant="bob", id="rb")
    assert request_block_hashes(a, 32) == request_block_hashes(b, 32)


def test_token_ids_take_precedence_and_estimates():
    r = make_request(prompt_token_ids=list(range(100)))
    assert estimate_prompt_tokens(r) == 100 and len(request_block_hashes(r, 32)) == 3
    assert estimate_prompt_tokens(make_request("abcd" * 10)) == 10
    assert text_block_hashes("é" * 64, 32, 0) == text_block_hashes("é" * 64, 32, 0)
