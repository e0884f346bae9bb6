"""KV-event translation: vLLM's block events -> natsched hashes, bounded, and robust to garbage.

No vLLM here: events are built in vLLM's wire shape (msgpack ``[ts, [event maps], dp_rank]``,
events tagged with ``type``), the real engine is exercised in ``test_vllm_*``.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from natsched.wire.blocks import request_block_hashes, root_hash, token_block_hashes
from natsched.wire.schema import Request
from natsched.workers.kv_events import KvEventSubscriber, KvTranslator, decode_batch

BS = 4  # small blocks keep the token lists readable


def stored(hashes, parent, tokens, block_size=BS, **extra):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": "GPU", **extra}


def removed(hashes, **extra):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", **extra}


def kinds(deltas):
    return [(k, list(h)) for k, h in deltas]


def test_chain_matches_the_routers_hashes_for_token_prompts():
    tokens = list(range(100, 112))  # 3 blocks of 4
    req = Request(id="r", tenant="t", cls="online", model="m", prompt_token_ids=tokens + [7, 7])  # + partial block
    tr = KvTranslator("m", BS)
    # vLLM may store a prompt in two steps (chunked prefill): the second names its parent
    d1 = tr.apply_batch([stored([11, 12], None, tokens[:8])])
    d2 = tr.apply_batch([stored([13], 12, tokens[8:12])])
    expected = request_block_hashes(req, BS)
    assert d1 + d2 == [("stored", expected[:2]), ("stored", expected[2:])]
    assert sorted(tr.cached_hashes()) == sorted(expected)
    assert expected == token_block_hashes(tokens, BS, root_hash("m"))


def test_other_model_names_give_other_chains():
    a, b = KvTranslator("m1", BS), KvTranslator("m2", BS)
    ev = [stored([1], None, [1, 2, 3, 4])]
    assert a.apply_batch(ev)[0][1] != b.apply_batch(ev)[0][1]


def test_removed_cleared_and_duplicate_copies():
    tr = KvTranslator("m", BS)
    (_, hs), = tr.apply_batch([stored([1, 2], None, list(range(8)))])
    # a second physical block with the same content (two requests computed it at once)
    assert tr.apply_batch([stored([2], 1, list(range(4, 8)))]) == []
    assert tr.apply_batch([removed([2])]) == []  # one copy left: still cached
    assert tr.apply_batch([removed([2])]) == [("removed", [hs[1]])]
    assert tr.apply_batch([removed([99])]) == []
    assert tr.counters.unknown_removed == 1
    assert tr.apply_batch([{"type": "AllBlocksCleared"}]) == [("cleared", [])]
    assert tr.cached_hashes() == [] and len(tr) == 0


def test_runs_of_one_kind_are_merged_in_event_order():
    tr = KvTranslator("m", BS)
    tr.apply_batch([stored([1], None, [1, 2, 3, 4])])
    out = tr.apply_batch([stored([2], None, [5, 6, 7, 8]), stored([3], None, [9, 9, 9, 9]), removed([1]),
                          stored([4], None, [0, 0, 0, 0])])
    assert [k for k, _ in out] == ["stored", "removed", "stored"]
    assert len(out[0][1]) == 2


def test_unmappable_unresolved_and_ignored_events_are_counted_not_applied():
    tr = KvTranslator("m", BS)
    assert tr.apply_batch([stored([1], None, [1, 2, 3, 4, 5, 6, 7, 8])]) == []  # 8 tokens for 1 block
    assert tr.apply_batch([stored([1], None, list(range(16)), block_size=16)]) == []  # other block size
    assert tr.counters.unmappable == 2
    assert tr.apply_batch([stored([5], 777, [1, 2, 3, 4])]) == []  # parent never seen
    assert tr.counters.unresolved_parent == 1
    assert tr.apply_batch([stored([6], None, [1, 2, 3, 4], medium="DISK"),  # a tier the router does not price
                           stored([7], None, [1, 2, 3, 4], group_idx=1),  # second KV group
                           {"type": "SomethingNew", "x": 1}]) == []
    assert tr.counters.ignored == 3
    assert tr.cached_hashes() == []


def test_bad_events_are_skipped_and_counted_the_rest_applies():
    tr = KvTranslator("m", BS)
    out = tr.apply_batch([
        "garbage", {"no": "type"}, stored("x", None, [1, 2, 3, 4]), stored([1], None, ["a", "b", "c", "d"]),
        removed([]), stored([True], None, [1, 2, 3, 4]),
        stored([2], None, [1, 2, 3, 4]),
    ])
    assert tr.counters.undecodable == 6
    assert kinds(out) == [("stored", token_block_hashes([1, 2, 3, 4], BS, root_hash("m")))]


def test_array_encoded_events_of_older_vllm_versions():
    tr = KvTranslator("m", BS)
    out = tr.apply_batch([["BlockStored", [1], None, [1, 2, 3, 4], BS, None, "GPU"], ["BlockRemoved", [1], "GPU"],
                          ["AllBlocksCleared"]])
    assert [k for k, _ in out] == ["stored", "removed", "cleared"]


def test_bytes_hashes_work_like_ints():
    tr = KvTranslator("m", BS)
    a, b = b"\x01" * 32, b"\x02" * 32
    out = tr.apply_batch([stored([a], None, [1, 2, 3, 4]), stored([b], a, [5, 6, 7, 8])])
    assert out[0][1] == token_block_hashes(list(range(1, 9)), BS, root_hash("m"))


def test_memory_is_bounded_and_forgotten_blocks_are_reported_removed():
    tr = KvTranslator("m", BS, max_entries=3)
    hs = tr.apply_batch([stored([1, 2, 3], None, list(range(12)))])[0][1]
    out = tr.apply_batch([stored([4], 3, [9, 9, 9, 9])])
    assert out[0] == ("stored", out[0][1]) and out[1] == ("removed", [hs[0]])
    assert len(tr) == 3 and tr.counters.evicted == 1
    assert hs[0] not in tr.cached_hashes()


def test_text_aliases_follow_their_token_block():
    tr = KvTranslator("m", BS)
    tok = token_block_hashes(list(range(8)), BS, root_hash("m"))
    # attached before vLLM stored the block: announced with it
    assert tr.attach([(tok[1], 501), (tok[1], 502)]) == []
    out = tr.apply_batch([stored([1, 2], None, list(range(8)))])
    assert out == [("stored", [tok[0], tok[1], 501, 502])]
    # attached while cached (a prefix hit stores nothing new): announced at once
    assert tr.attach([(tok[0], 500), (tok[0], 500)]) == [("stored", [500])]
    # one text hash attached to two token blocks stays until both are gone
    assert tr.attach([(tok[0], 502)]) == []
    assert tr.apply_batch([removed([2])]) == [("removed", [tok[1], 501])]
    assert tr.apply_batch([removed([1])]) == [("removed", [tok[0], 500, 502])]
    assert tr.cached_hashes() == []
    # re-stored later: the attachments still hold
    assert sorted(tr.apply_batch([stored([1], None, list(range(4)))])[0][1]) == sorted([tok[0], 500, 502])


def test_alias_map_is_bounded():
    tr = KvTranslator("m", BS, max_aliases=2)
    tok = token_block_hashes(list(range(12)), BS, root_hash("m"))
    tr.apply_batch([stored([1, 2, 3], None, list(range(12)))])
    tr.attach([(tok[0], 900)])
    tr.attach([(tok[1], 901)])
    out = tr.attach([(tok[2], 902)])
    assert ("removed", [900]) in out and ("stored", [902]) in out
    assert 900 not in tr.cached_hashes()


def test_decode_batch_accepts_vllm_shape_and_rejects_garbage():
    payload = msgspec.msgpack.encode([1.5, [stored([1], None, [1, 2, 3, 4])], 0])
    ts, events = decode_batch(payload)
    assert ts == 1.5 and events[0]["type"] == "BlockStored"
    for bad in (b"\xc1\xc1", msgspec.msgpack.encode("hi"), msgspec.msgpack.encode([1.0, "x"]),
                msgspec.msgpack.encode({"ts": "x", "events": []})):
        with pytest.raises(ValueError):
            decode_batch(bad)


# --------------------------------------------------------------------------- ZMQ subscriber
def _frames(seq: int, events) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([0.0, events, 0])]


def _subscriber():
    deltas, resyncs = [], []
    sub = KvEventSubscriber(KvTranslator("m", BS), lambda k, h: deltas.append((k, list(h))), resyncs.append)
    return sub, deltas, resyncs


def test_subscriber_counts_garbage_and_asks_for_a_snapshot():
    sub, deltas, resyncs = _subscriber()
    sub.handle_frames(_frames(0, [stored([1], None, [1, 2, 3, 4])]))
    assert deltas and not resyncs
    sub.handle_frames([b"only one frame"])
    sub.handle_frames([b"", (1).to_bytes(8, "big"), b"\xc1 not msgpack"])
    assert sub.counters.undecodable == 2 and len(resyncs) == 2
    sub.handle_frames(_frames(2, ["bad event"]))  # decodable batch, undecodable event
    assert len(resyncs) == 3
    sub.handle_frames(_frames(5, []))  # batches 3 and 4 never arrived
    assert sub.counters.gaps == 1 and "lost 2" in resyncs[-1]
    assert sub.counters.snapshots_requested == 4


def test_subscriber_treats_a_sequence_restart_as_a_cleared_cache():
    sub, deltas, _ = _subscriber()
    sub.handle_frames(_frames(7, [stored([1], None, [1, 2, 3, 4])]))
    sub.handle_frames(_frames(0, []))
    assert deltas[-1] == ("cleared", []) and sub.translator.cached_hashes() == []


async def test_subscriber_reads_a_real_zmq_publisher():
    import zmq

    sub, deltas, resyncs = _subscriber()
    endpoint = sub.bind()
    assert "*" not in endpoint  # vLLM's publisher connects (it binds only for '*' endpoints)
    sub.start()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.connect(endpoint)
    try:
        for _ in range(100):  # PUB/SUB joins asynchronously: resend until the first one lands
            pub.send_multipart(_frames(0, []))
            await asyncio.sleep(0.02)
            if sub.counters.batches:
                break
        pub.send_multipart(_frames(1, [stored([1], None, [1, 2, 3, 4])]))
        pub.send_multipart([b"", (2).to_bytes(8, "big"), b"garbage"])
        for _ in range(100):
            await asyncio.sleep(0.02)
            if resyncs:
                break
        assert ("stored", token_block_hashes([1, 2, 3, 4], BS, root_hash("m"))) in deltas
        assert sub.counters.undecodable == 1 and resyncs
    finally:
        pub.close(linger=0)
        ctx.term()
        await sub.close()


async def test_batches_published_before_we_connected_are_replayed_from_vllms_own_publisher():
    """vLLM's own ZmqEventPublisher (bound, as ``vllm serve`` runs it, with its replay socket): a
    subscriber that connects late asks for what it missed and learns the whole cache."""
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

    from natsched.bus.server import free_port

    port, replay = free_port(), free_port()
    pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}")

    def batch(h, parent, tokens):
        return KVEventBatch(ts=0.0, events=[BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=tokens,
                                                        block_size=BS, lora_id=None, medium="GPU", lora_name=None)])

    deltas, resyncs = [], []
    sub = KvEventSubscriber(KvTranslator("m", BS), lambda k, h: deltas.append((k, list(h))), resyncs.append,
                            connect=f"tcp://127.0.0.1:{port}", replay=f"tcp://127.0.0.1:{replay}")
    try:
        pub.publish(batch(1, None, [1, 2, 3, 4]))  # nobody listens yet: only the replay buffer keeps these
        pub.publish(batch(2, 1, [5, 6, 7, 8]))
        for _ in range(500):  # its thread has sent them (into no socket) and buffered them for replay
            if len(pub._buffer) >= 2:
                break
            await asyncio.sleep(0.01)
        sub.bind()
        sub.start()
        chain = token_block_hashes(list(range(1, 17)), BS, root_hash("m"))
        for i in range(2, 200):  # keep publishing until the late subscriber has joined
            pub.publish(batch(i + 1, i, [4 * i + 1, 4 * i + 2, 4 * i + 3, 4 * i + 4]))
            await asyncio.sleep(0.02)
            if sub.counters.batches >= 3:
                break
        await asyncio.sleep(0)
        assert sub.replayed >= 2 and not resyncs and sub.counters.gaps == 0
        assert set(chain[:3]) <= set(sub.translator.cached_hashes())  # the first blocks, from the replay
        assert sub.counters.unresolved_parent == 0  # every later block found its parent
    finally:
        pub.shutdown()
        await sub.close()


async def test_a_late_subscriber_learns_what_an_idle_publisher_buffered_without_a_new_batch():
    """vLLM's own ZmqEventPublisher publishes two batches and then nothing: a subscriber started
    afterwards learns them from the replay socket at once (waiting for a live batch to notice the
    gap would leave an idle server's cache unknown, and a live batch sent before the SUB socket
    joined is lost to ZMQ's slow joiner)."""
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

    from natsched.bus.server import free_port
    from tests.factories.core import wait_for

    port, replay = free_port(), free_port()
    pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}")
    deltas, resyncs = [], []
    sub = KvEventSubscriber(KvTranslator("m", BS), lambda k, h: deltas.append((k, list(h))), resyncs.append,
                            connect=f"tcp://127.0.0.1:{port}", replay=f"tcp://127.0.0.1:{replay}")
    try:
        for h, parent, tokens in ((1, None, [1, 2, 3, 4]), (2, 1, [5, 6, 7, 8])):
            pub.publish(KVEventBatch(ts=0.0, events=[BlockStored(
                block_hashes=[h], parent_block_hash=parent, token_ids=tokens, block_size=BS, lora_id=None,
                medium="GPU", lora_name=None)]))
        assert await wait_for(lambda: len(pub._buffer) >= 2)
        sub.start()
        chain = token_block_hashes(list(range(1, 9)), BS, root_hash("m"))
        assert await wait_for(lambda: set(chain) <= set(sub.translator.cached_hashes()), timeout=20)
        assert sub.replayed == 2 and not resyncs and sub.counters.gaps == 0
    finally:
        pub.shutdown()
        await sub.close()


async def test_live_copies_of_replayed_batches_are_dropped_and_a_lower_sequence_after_is_a_restart():
    sub, deltas, resyncs = _subscriber()
    sub.replay = "tcp://127.0.0.1:1"  # never asked here: the replay socket already answered 3..4
    sub.handle_frames(_frames(3, [stored([1], None, [1, 2, 3, 4])]))
    sub.handle_frames(_frames(4, [stored([2], 1, [5, 6, 7, 8])]))
    sub._replayed = (3, 5)
    for seq in (3, 4):  # the live socket, connected before the replay, hands them over again
        await sub.handle_live(_frames(seq, []))
    assert ("cleared", []) not in deltas and len(sub.translator.cached_hashes()) == 2
    await sub.handle_live(_frames(5, [stored([3], 2, [9, 10, 11, 12])]))  # the next batch, in order
    assert len(sub.translator.cached_hashes()) == 3 and not resyncs
    await sub.handle_live(_frames(0, []))  # past the replay, a lower sequence: the publisher restarted
    assert deltas[-1] == ("cleared", []) and sub.translator.cached_hashes() == []


def test_cpu_offload_events_become_host_tier_deltas():
    """vLLM's offloading connector reports CPU copies by the GPU block's hash, often with no tokens."""
    tr = KvTranslator("m", BS)
    (_, ours), = tr.apply_batch([stored([1, 2], None, list(range(8)))])
    cpu = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [],
           "block_size": 0, "lora_id": None, "medium": "CPU"}
    assert tr.apply_batch([cpu]) == [("stored", ours, "host")]
    assert tr.apply_batch([removed([1, 2])]) == [("removed", ours)]  # the GPU evicts: the host copy stays
    assert sorted(tr.host_hashes()) == sorted(ours) and tr.cached_hashes() == []
    assert tr.apply_batch([removed([2], medium="CPU")]) == [("removed", [ours[1]], "host")]
    # a CPU block with whole token blocks but no GPU history is computed like a GPU one
    (h,) = tr.apply_batch([stored([7], None, [9, 9, 9, 9], medium="CPU")])
    assert h == ("stored", token_block_hashes([9, 9, 9, 9], BS, root_hash("m")), "host")
    # unknown and untranslatable: counted, not guessed
    before = tr.counters.unresolved_parent
    assert tr.apply_batch([{**cpu, "block_hashes": [42]}]) == []
    assert tr.counters.unresolved_parent == before + 1
    assert tr.apply_batch([stored([8], None, [1, 2, 3, 4], medium="DISK")]) == []  # another medium: ignored
