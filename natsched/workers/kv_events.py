"""vLLM's own KV-cache events, translated into natsched's prefix hashes.

Why translate: vLLM hashes blocks with a per-process seed, so its hashes mean nothing to the
router. Each ``BlockStored`` carries the blocks' token ids and the parent's (vLLM) hash, which is
enough to recompute *our* chain with :mod:`natsched.wire.blocks` (same block size, first parent
``root_hash(model)``): the router computes exactly these hashes for a token-id request. A bounded
map vLLM-hash -> our hash resolves the parents of later blocks and the hashes of removals.

Text prompts: the router hashes their text (:func:`natsched.wire.blocks.text_block_hashes`), which can never
equal a token-block hash. The engine therefore *attaches* each text-block hash of a request to
the token block that holds the request's tokens for it (:mod:`natsched.workers.textmap`); an attached
text hash is reported stored while its token block is cached and removed when vLLM evicts it.

Two parts:

- :class:`KvTranslator` — pure state machine: vLLM events in, ``(kind, hashes)`` deltas out
  (kinds ``stored`` / ``removed`` / ``cleared``), plus :meth:`~KvTranslator.cached_hashes` for
  snapshots. Memory is bounded (``max_entries`` blocks, ``max_aliases`` attachments).
- :class:`KvEventSubscriber` — a ZMQ SUB socket fed by vLLM's ZMQ publisher. It *binds*
  (the engine core connects to it), so its port is known before the engine starts and there is
  no race for a port. Frames it cannot decode, sequence gaps and unresolvable parents are
  counted; garbage and gaps also ask for a snapshot, because the reader's view may be stale.

Tiers: vLLM's events name the ``medium`` of a block. ``GPU`` (or none) is the prefix cache
proper; ``CPU`` is an offload tier (vLLM's KV offloading connector, a host pool). A CPU block's
vLLM hash is the hash of the GPU block it copies (offloading keeps the key), so it is translated
through the GPU map (or, when the event carries whole blocks of token ids, computed like a GPU
block); the resulting deltas carry the tier (``(kind, hashes, "host")``) and the router prices
such a hit by its transfer time. Other media and KV groups are counted as ignored.

Decoding is deliberately untyped (msgpack -> Python, then checked field by field) so an event
type or field added by a newer vLLM is skipped and counted, never fatal for the whole batch.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Callable, Hashable, Iterable, Sequence

from natsched.wire.blocks import root_hash, token_block_hashes
from natsched.wire.ids import BlockHash

log = logging.getLogger(__name__)

Delta = tuple  # (kind, hashes) for the GPU tier, (kind, hashes, "host") for the host tier

#: positional field order of events in vLLM versions that encoded them as arrays
_ARRAY_FIELDS = {  # vLLM's older encoding, and SGLang's (python/sglang/srt/disaggregation/kv_events.py)
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
#: the tier vLLM's scheduler allocates from; offload tiers (CPU, storage) are not "cached here"
PRIMARY_MEDIA = (None, "GPU")
#: vLLM's host-memory offload tier, reported to the router as tier "host"
HOST_MEDIA = ("CPU",)


class EventFormatError(ValueError):
    """One event (or a whole batch) whose shape is not what vLLM documents."""


@dataclass
class KvEventCounters:
    """What happened to the events, for logs, metrics and tests."""

    batches: int = 0
    events: int = 0
    stored_blocks: int = 0  # our hashes that became cached
    removed_blocks: int = 0  # our hashes that stopped being cached
    cleared: int = 0
    undecodable: int = 0  # frames/batches/events that could not be decoded
    unmappable: int = 0  # stores whose token ids do not cut into our block size
    unresolved_parent: int = 0  # stores whose parent we never saw (missed events)
    unknown_removed: int = 0  # removals of blocks we never saw
    ignored: int = 0  # other tiers / KV groups / event types
    evicted: int = 0  # map entries dropped to stay within bounds
    gaps: int = 0  # publisher sequence gaps (lost batches)
    snapshots_requested: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class _Entry:
    ours: BlockHash
    copies: int  # physical vLLM blocks currently holding this vLLM hash


class KvTranslator:
    """vLLM block events -> natsched hash deltas; pure and synchronous (one thread uses it)."""

    def __init__(self, model: str, block_size: int, max_entries: int = 1 << 20, max_aliases: int = 1 << 18) -> None:
        self.model = model
        self.block_size = block_size
        self.root = root_hash(model)
        self.max_entries = max(1, max_entries)
        self.max_aliases = max(1, max_aliases)
        self.counters = KvEventCounters()
        self._by_vllm: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._live: dict[BlockHash, int] = {}  # our token hash -> live vLLM hashes mapping to it
        self._aliases: OrderedDict[BlockHash, set[BlockHash]] = OrderedDict()  # token hash -> text hashes
        self._alias_live: dict[BlockHash, int] = {}  # text hash -> live token blocks it is attached to
        self._host: OrderedDict[Hashable, BlockHash] = OrderedDict()  # vLLM hash -> ours, CPU tier

    # ------------------------------------------------------------------ queries
    def cached_hashes(self) -> list[BlockHash]:
        """Everything cached now: token-block hashes and the text hashes attached to them."""
        return list(self._live) + list(self._alias_live)

    def host_hashes(self) -> list[BlockHash]:
        """Everything in the CPU offload tier now (our hashes)."""
        return list(dict.fromkeys(self._host.values()))

    def is_cached(self, h: int) -> bool:
        return h in self._live or h in self._alias_live

    def __len__(self) -> int:
        return len(self._by_vllm)

    # ------------------------------------------------------------------ events
    def apply_batch(self, events: Iterable[Any]) -> list[Delta]:
        """Apply one decoded batch's events in order; returns the deltas to publish (merged runs)."""
        out = _DeltaList()
        self.counters.batches += 1
        for raw in events:
            self.counters.events += 1
            try:
                kind, ev = _event_fields(raw)
            except EventFormatError as exc:
                self.counters.undecodable += 1
                log.warning("kv events: undecodable event skipped: %s", exc)
                continue
            if kind in ("BlockStored", "BlockRemoved") and self._is_host(ev):
                self._host_event(kind, ev, out)
            elif kind == "BlockStored":
                self._stored(ev, out)
            elif kind == "BlockRemoved":
                self._removed(ev, out)
            elif kind == "AllBlocksCleared":
                self.clear()
                out.add("cleared", [])
            else:
                self.counters.ignored += 1
        return out.deltas

    def clear(self) -> None:
        """Forget every cached block (vLLM reset its prefix cache, or the engine is gone)."""
        self.counters.cleared += 1
        self._by_vllm.clear()
        self._live.clear()
        self._alias_live.clear()
        self._host.clear()

    def _stored(self, ev: dict, out: "_DeltaList") -> None:
        if not self._primary(ev):
            return
        try:
            hashes = _hash_list(ev.get("block_hashes"), "block_hashes")
            parent = ev.get("parent_block_hash")
            if parent is not None:
                _check_hash(parent, "parent_block_hash")
            tokens = ev.get("token_ids")
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise EventFormatError("token_ids must be a list of integers")
            size = ev.get("block_size")
            if not isinstance(size, int) or size <= 0:
                raise EventFormatError("block_size must be a positive integer")
        except EventFormatError as exc:
            self.counters.undecodable += 1
            log.warning("kv events: bad BlockStored skipped: %s", exc)
            return
        if size != self.block_size or len(tokens) != len(hashes) * size:
            # partial/null blocks or another block size: these tokens cannot be cut into our chain
            self.counters.unmappable += 1
            return
        if parent is None:  # a LoRA adapter's blocks chain from its own name, as its requests do
            lora = ev.get("lora_name")
            our_parent = root_hash(lora) if isinstance(lora, str) and lora else self.root
        else:
            entry = self._by_vllm.get(parent)
            if entry is None:
                self.counters.unresolved_parent += 1
                log.debug("kv events: parent %r of %d stored blocks unknown (missed events?)", parent, len(hashes))
                return
            our_parent = entry.ours
        ours = token_block_hashes(tokens, size, our_parent)
        stored: list[BlockHash] = []
        for vh, h in zip(hashes, ours):
            entry = self._by_vllm.get(vh)
            if entry is not None and entry.ours == h:
                entry.copies += 1  # a second physical block with the same content
                self._by_vllm.move_to_end(vh)
                continue
            if entry is not None:  # same vLLM hash, other content: trust the newest
                out.add("removed", self._drop_ours(entry.ours))
            self._by_vllm[vh] = _Entry(h, 1)
            self._by_vllm.move_to_end(vh)
            self._add_ours(h, stored)
        out.add("stored", stored)
        self._bound(out)

    def _removed(self, ev: dict, out: "_DeltaList") -> None:
        if not self._primary(ev):
            return
        try:
            hashes = _hash_list(ev.get("block_hashes"), "block_hashes")
        except EventFormatError as exc:
            self.counters.undecodable += 1
            log.warning("kv events: bad BlockRemoved skipped: %s", exc)
            return
        removed: list[BlockHash] = []
        for vh in hashes:
            entry = self._by_vllm.get(vh)
            if entry is None:
                self.counters.unknown_removed += 1
                continue
            entry.copies -= 1
            if entry.copies <= 0:
                del self._by_vllm[vh]
                removed.extend(self._drop_ours(entry.ours))
        out.add("removed", removed)

    @staticmethod
    def _is_host(ev: dict) -> bool:
        return ev.get("medium") in HOST_MEDIA and ev.get("group_idx") in (None, 0)

    def _host_event(self, kind: str, ev: dict, out: "_DeltaList") -> None:
        """A CPU-tier store or removal: translated through the GPU map (same vLLM hash)."""
        try:
            hashes = _hash_list(ev.get("block_hashes"), "block_hashes")
        except EventFormatError as exc:
            self.counters.undecodable += 1
            log.warning("kv events: bad host-tier %s skipped: %s", kind, exc)
            return
        changed: list[BlockHash] = []
        if kind == "BlockRemoved":
            for vh in hashes:
                ours = self._host.pop(vh, None)
                if ours is None:
                    self.counters.unknown_removed += 1
                elif ours not in self._host.values():
                    changed.append(ours)
            out.add("removed", changed, "host")
            return
        ours_list = self._host_ours(ev, hashes)
        for vh, ours in zip(hashes, ours_list):
            if ours is None:
                self.counters.unresolved_parent += 1
                continue
            if vh not in self._host:
                changed.append(ours)
            self._host[vh] = ours
            self._host.move_to_end(vh)
        while len(self._host) > self.max_entries:
            self._host.popitem(last=False)
            self.counters.evicted += 1
        out.add("stored", changed, "host")

    def _host_ours(self, ev: dict, hashes: list) -> list[BlockHash | None]:
        """Our hash of each CPU block: the GPU block's it copies, else computed from whole token blocks."""
        known = [e.ours if (e := self._by_vllm.get(vh)) is not None else self._host.get(vh) for vh in hashes]
        tokens, size = ev.get("token_ids"), ev.get("block_size")
        if all(k is not None for k in known) or size != self.block_size or not isinstance(tokens, list) \
                or len(tokens) != len(hashes) * self.block_size:
            return known
        parent = ev.get("parent_block_hash")
        entry = self._by_vllm.get(parent) if parent is not None else None
        our_parent = self.root if parent is None else (entry.ours if entry is not None else self._host.get(parent))
        if our_parent is None:
            return known
        return list(token_block_hashes(tokens, size, our_parent))

    def _primary(self, ev: dict) -> bool:
        if ev.get("medium") not in PRIMARY_MEDIA or ev.get("group_idx") not in (None, 0):
            self.counters.ignored += 1
            return False
        return True

    # ------------------------------------------------------------------ liveness
    def _add_ours(self, h: BlockHash, stored: list[BlockHash]) -> None:
        n = self._live.get(h, 0)
        self._live[h] = n + 1
        if n == 0:
            self.counters.stored_blocks += 1
            stored.append(h)
            for t in self._aliases.get(h, ()):
                self._alias_up(t, stored)

    def _drop_ours(self, h: BlockHash) -> list[BlockHash]:
        """One live vLLM hash of ``h`` is gone; returns what stopped being cached (h, its texts)."""
        removed: list[BlockHash] = []
        n = self._live.get(h, 0)
        if n > 1:
            self._live[h] = n - 1
        elif n == 1:
            del self._live[h]
            self.counters.removed_blocks += 1
            removed.append(h)
            for t in self._aliases.get(h, ()):
                self._alias_down(t, removed)
        return removed

    def _alias_up(self, t: BlockHash, stored: list[BlockHash]) -> None:
        n = self._alias_live.get(t, 0)
        self._alias_live[t] = n + 1
        if n == 0:
            stored.append(t)

    def _alias_down(self, t: BlockHash, removed: list[BlockHash]) -> None:
        n = self._alias_live.get(t, 0)
        if n <= 1:
            if n:
                del self._alias_live[t]
                removed.append(t)
        else:
            self._alias_live[t] = n - 1

    def _bound(self, out: "_DeltaList") -> None:
        """Keep the map within ``max_entries``: forget the oldest blocks (reported removed)."""
        while len(self._by_vllm) > self.max_entries:
            _, entry = self._by_vllm.popitem(last=False)
            self.counters.evicted += 1
            out.add("removed", self._drop_ours(entry.ours))

    # ------------------------------------------------------------------ text aliases
    def attach(self, pairs: Sequence[tuple[int, int]]) -> list[Delta]:
        """Attach text hashes to token-block hashes ``(token_hash, text_hash)``.

        Returns a ``stored`` delta for text hashes whose token block is already cached (a prefix
        hit stores nothing new in vLLM, so no event would ever announce them).
        """
        stored: list[BlockHash] = []
        for tok, txt in pairs:
            tok, txt = BlockHash(tok), BlockHash(txt)
            attached = self._aliases.get(tok)
            if attached is None:
                attached = self._aliases[tok] = set()
            else:
                self._aliases.move_to_end(tok)
            if txt in attached:
                continue
            attached.add(txt)
            if tok in self._live:
                self._alias_up(txt, stored)
        removed: list[BlockHash] = []
        while len(self._aliases) > self.max_aliases:
            tok, texts = self._aliases.popitem(last=False)
            self.counters.evicted += 1
            if tok in self._live:
                for t in texts:
                    self._alias_down(t, removed)
        deltas: list[Delta] = []
        if removed:
            deltas.append(("removed", removed))
        if stored:
            deltas.append(("stored", stored))
        return deltas


class _DeltaList:
    """Deltas in event order, consecutive runs of one kind merged into one message."""

    def __init__(self) -> None:
        self.deltas: list[Delta] = []

    def add(self, kind: str, hashes: list[BlockHash], tier: str | None = None) -> None:
        if not hashes and kind != "cleared":
            return
        last = self.deltas[-1] if self.deltas else None
        if last is not None and last[0] == kind and kind != "cleared" and (last[2] if len(last) > 2 else None) == tier:
            last[1].extend(hashes)
        else:
            self.deltas.append((kind, list(hashes)) if tier is None else (kind, list(hashes), tier))


def _check_hash(value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, bytes)):
        raise EventFormatError(f"{what} must be an integer or bytes, got {type(value).__name__}")


def _hash_list(value: Any, what: str) -> list:
    if not isinstance(value, list) or not value:
        raise EventFormatError(f"{what} must be a non-empty list")
    for v in value:
        _check_hash(v, what)
    return value


def _event_fields(raw: Any) -> tuple[str, dict]:
    """(type, fields) of one event, in either of vLLM's encodings (tagged map or tagged array)."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        if not isinstance(kind, str):
            raise EventFormatError("event map without a 'type' tag")
        return kind, raw
    if isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _ARRAY_FIELDS.get(kind)
        if names is None:
            return kind, {}
        return kind, dict(zip(names, raw[1:]))
    raise EventFormatError(f"event is a {type(raw).__name__}, not a tagged map or array")


def decode_batch(payload: bytes) -> tuple[float, list]:
    """msgpack ``EventBatch`` -> (ts, events); raises :class:`EventFormatError` on anything else."""
    import msgspec

    try:
        batch = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError) as exc:
        raise EventFormatError(f"not msgpack: {exc}") from None
    if isinstance(batch, dict):  # map-encoded batch
        ts, events = batch.get("ts"), batch.get("events")
    elif isinstance(batch, (list, tuple)) and len(batch) >= 2:
        ts, events = batch[0], batch[1]
    else:
        raise EventFormatError(f"batch is a {type(batch).__name__}, not [ts, events, ...]")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(events, list):
        raise EventFormatError("batch must be [ts: number, events: list, ...]")
    return float(ts), events


#: how long a replay socket may take to answer before the gap is declared
REPLAY_TIMEOUT_S = 5.0


class KvEventSubscriber:
    """Reads vLLM's ZMQ KV-event stream and feeds a :class:`KvTranslator` on the event loop.

    ``emit(kind, hashes)`` receives each delta (the engine's cache listener); ``resync(reason)``
    is called when the view may have drifted (garbage, a lost batch), to have a snapshot published.
    """

    def __init__(
        self,
        translator: KvTranslator,
        emit: Callable[..., None],
        resync: Callable[[str], None],
        host: str = "127.0.0.1",
        port: int = 0,
        topic: str = "",
        connect: str | None = None,
        replay: str | None = None,
    ) -> None:
        self.translator = translator
        self.emit = emit
        self.resync = resync
        self.host = host
        self.port = port
        self.topic = topic.encode()
        self.connect = connect  # a publisher that binds (``vllm serve``'s ``tcp://*:PORT``): we connect to it
        # its replay socket (``replay_endpoint``): batches we missed — a gap, or everything before
        # we connected — are asked for again there before a gap is declared
        self.replay = replay
        self.replayed = 0  # batches recovered from the replay socket
        self.endpoint: str | None = None
        self._ctx: Any = None
        self._sock: Any = None
        self._task: asyncio.Task | None = None
        self._next_seq: int | None = None
        self._replayed: tuple[int, int] | None = None  # [first, last+1] the start-up replay applied

    @property
    def counters(self) -> KvEventCounters:
        return self.translator.counters

    def bind(self) -> str:
        """Bind the SUB socket (or connect it, given ``connect``); returns the endpoint vLLM's
        publisher must *connect* to (or the one we connected to)."""
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._sock.setsockopt(zmq.RCVHWM, 100_000)
        self._sock.setsockopt(zmq.LINGER, 0)
        if self.connect:
            self._sock.connect(self.connect)  # ZMQ reconnects by itself when the server restarts
            self.endpoint = self.connect
            return self.endpoint
        if self.port:
            self._sock.bind(f"tcp://{self.host}:{self.port}")
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{self.host}")
        # no '*' in it: vLLM's publisher connects to a concrete address instead of binding
        self.endpoint = f"tcp://{self.host}:{self.port}"
        return self.endpoint

    def start(self) -> None:
        if self._sock is None:
            self.bind()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-events")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _run(self) -> None:
        if self.replay:  # what the server holds already: learnt now, not at its next event batch
            await self.catch_up(0, None)
        while True:
            try:
                frames = await self._sock.recv_multipart()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # socket closed under us, or a zmq hiccup
                log.warning("kv events: receive failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            await self.handle_live(frames)

    async def handle_live(self, frames: Sequence[bytes]) -> None:
        """One message from the live socket: batches missed before it are replayed first, and a
        batch the start-up replay already applied (it reached both sockets) is dropped."""
        if self.replay and len(frames) == 3 and len(frames[1]) == 8:
            seq, expected = int.from_bytes(frames[1], "big", signed=True), self._next_seq
            if self._replayed is not None:
                if self._replayed[0] <= seq < self._replayed[1]:
                    return  # a copy of a replayed batch
                self._replayed = None  # past the replay: a lower sequence now means a restart
            if (expected is None and seq > 0) or (expected is not None and seq > expected):
                await self.catch_up(0 if expected is None else expected, seq)
        self.handle_frames(frames)

    async def catch_up(self, start: int, stop: int | None) -> bool:
        """Ask the replay socket for batches ``start..stop-1`` (``None``: all it buffers, at start-up)
        and apply them in order; True when the sequence is whole again (else the gap stands, and
        is handled as one).

        The publisher answers ``[b"", (topic,) seq, payload]`` per buffered batch from ``start``,
        then ``seq = -1`` (vLLM sends the topic frame, SGLang does not). A start-up replay
        remembers the sequences it applied: the live socket, connected first, may hand the same
        batches over again.
        """
        import zmq

        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        first = None
        try:
            sock.connect(self.replay)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(REPLAY_TIMEOUT_S * 1000):
                    log.warning("kv events: replay from %d from %s timed out", start, self.replay)
                    break
                frames = await sock.recv_multipart()
                body = frames[1:] if frames and frames[0] == b"" else frames
                if len(body) not in (2, 3) or len(body[-2]) != 8:
                    self._garbage(f"replay frame of {len(frames)} parts")
                    break
                seq = int.from_bytes(body[-2], "big", signed=True)
                if seq < 0:
                    break  # end of the buffer
                if (stop is None or seq < stop) and (self._next_seq is None or seq == self._next_seq):
                    self.handle_frames([b"", body[-2], body[-1]])
                    self.replayed += 1
                    first = seq if first is None else first
        except Exception as exc:  # the replay socket is a help, never a reason to stop reading
            log.warning("kv events: replay from %s failed: %s", self.replay, exc)
        finally:
            sock.close(linger=0)
        if stop is None:
            if first is not None:
                self._replayed = (first, self._next_seq)
                log.info("kv events: learnt batches %d..%d from the replay socket at start", first,
                         self._next_seq - 1)
            return True
        whole = self._next_seq == stop
        if whole:
            log.info("kv events: recovered batches %d..%d from the replay socket", start, stop - 1)
        return whole

    def handle_frames(self, frames: Sequence[bytes]) -> None:
        """One ZMQ message ``[topic, seq (8 bytes, big endian), payload]``; never raises."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self._garbage(f"expected 3 frames (topic, 8-byte seq, payload), got {len(frames)}")
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        self._check_seq(seq)
        try:
            _, events = decode_batch(frames[2])
        except EventFormatError as exc:
            self._garbage(str(exc))
            return
        before = self.counters.undecodable
        try:
            deltas = self.translator.apply_batch(events)
        except Exception as exc:  # a translator bug must not kill the reader
            log.exception("kv events: batch %d could not be applied", seq)
            self._garbage(f"apply failed: {exc}")
            return
        for delta in deltas:
            self.emit(*delta)
        if self.counters.undecodable > before:
            self._request_resync("undecodable events in batch %d" % seq)

    def _check_seq(self, seq: int) -> None:
        expected = self._next_seq
        self._next_seq = seq + 1
        if expected is None or seq == expected:
            return
        if seq < expected:  # the publisher restarted: everything it told us is void
            log.warning("kv events: sequence restarted (%d after %d); clearing", seq, expected - 1)
            self.translator.clear()
            self.emit("cleared", [])
            return
        self.counters.gaps += 1
        self._request_resync(f"lost {seq - expected} event batches ({expected}..{seq - 1})")

    def _garbage(self, why: str) -> None:
        self.counters.undecodable += 1
        log.warning("kv events: undecodable message (%s)", why)
        self._request_resync(why)

    def _request_resync(self, why: str) -> None:
        self.counters.snapshots_requested += 1
        self.resync(why)
