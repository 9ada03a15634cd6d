"""The layout of ZeRO-1's in-memory copies, shared by the ranks that write and read them (`axond.train.daemon_copy`,
`axond.train.relay`) and the worker daemon that keeps other nodes' copies (`axond.worker.buddy_relay`).

A *region* holds one rank's block of virtual shards twice (double buffering): a header page of int64 words
(`MAGIC`, the layout's fingerprint, two spare words, then `SLOT_WORDS` words per slot: state, tag, first shard, shard
count, lineage, rows per shard, scalars per shard, spare), then two slots of `slot_bytes` each. A slot holds its rows
(count x width x shard elements, padded to 8 bytes) then its scalars (count x nscalars float64). A slot's `state`
word is cleared before its data is written and set to `VALID` after every other word: a copy cut half-way is never
read. A rank's own copy in its worker daemon's memory is one region at offset 0 of its memfd.

The *held* memory of a node (one memfd per worker, every local rank inherits it) keeps the buddy copies other
nodes' ranks sent to this node's worker: a directory page (`HELD_MAGIC`, then `ENTRIES` entries of `ENTRY_WORDS`
words: the source's key, its region's offset and slot bytes, the entry's last use), then the regions.

A rank asks its own worker to send a copy to the buddy's worker through words of its region's header page
(`FORWARD_*`, from word `FORWARD_BASE`: the request's sequence number, written last, the tag, the slot, the payload
bytes; the worker's answer: the sequence number done, written last, and the tag kept or a negative code) and the
buddy's relay address (`ADDRESS_BYTES` at byte `ADDRESS_AT`), then writes one byte to the pipe the worker reads
(`AXOND_COPY_FORWARD_FD`).

The relay's wire (a worker to a buddy's worker, one TCP connection per source rank): the receiver sends
`NONCE_BYTES` of nonce; the sender answers with HMAC-SHA256(job secret, `AUTH_CONTEXT` + nonce); the receiver answers
one byte (1: in). Then per copy the sender sends `REQUEST` (magic, source node key, source local rank, fingerprint,
tag, first, count, lineage, width, nscalars, payload bytes), the slot's payload, and a `VERDICT` word: the tag again
if the slot was not written while it was read (else -1: the copy is torn and never kept); the receiver answers one
int64: the tag kept, or a negative `REFUSED_*` code (nothing kept).
"""

from __future__ import annotations

import struct

MAGIC = 0x3148535F444E4F58
"""'XOND_SH1' little-endian: the header of a region."""
HEADER_BYTES = 4096
SLOT_WORDS = 8
STATE, TAG, FIRST, COUNT, LINEAGE, WIDTH, SCALARS = range(7)
"""The words of a slot's header, in order."""
VALID = 1
ALIGN = 4096

HELD_MAGIC = 0x31444C45485F4158
"""'XA_HELD1' little-endian: the directory page of a node's held memory."""
ENTRIES = 64
"""Sources one node keeps buddy copies of (the least recently written entry is reused beyond)."""
ENTRY_WORDS = 4
KEY_NODE, KEY_LOCAL, OFFSET, SLOT_BYTES = range(4)
"""An entry's words after the directory's first two (magic, entries in use): (node key, local rank), where its
region starts, its slot bytes. The entry's region's own header says what it holds."""
DIRECTORY_WORDS = 2 + ENTRIES * (ENTRY_WORDS + 1)
"""The directory page: magic, entries in use, the entries, then one last-write counter per entry."""

RELAY_MAGIC = 0x3159414C45525841
"""'AXRELAY1' little-endian: the first word of a copy sent to a buddy's worker."""
AUTH_CONTEXT = b"axond-relay-v1|"
NONCE_BYTES = 16
REQUEST = struct.Struct("<11q")
"""magic, source node key, source local rank, fingerprint, tag, first, count, lineage, width, nscalars, payload."""
ACK = struct.Struct("<q")
VERDICT = ACK
REFUSED_MALFORMED, REFUSED_TOO_LARGE, REFUSED_NO_MEMORY, REFUSED_TORN = -1, -2, -3, -4
"""What a worker answers instead of the tag kept: the request's fields do not fit together, the payload is over the
relay's bound, the memory could not be sized (a full /dev/shm), or the sender said its slot changed while it was
read."""
UNSENT = -5
"""A forward's answer when the worker could not send it (the relay unreachable, no secret yet, ...)."""

FORWARD_BASE = 32
"""The first header word of a forward request (after the slots' words)."""
FORWARD_SEQ, FORWARD_TAG, FORWARD_SLOT, FORWARD_BYTES, FORWARD_DONE, FORWARD_RESULT = range(6)
ADDRESS_AT = 512
ADDRESS_BYTES = 64
MAX_PAYLOAD = 1 << 36
"""The largest copy a worker keeps (64 GiB): one rank's block of shards."""


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def rows_bytes(count: int, width: int, shard: int, itemsize: int) -> int:
    """A slot's rows, padded to 8 bytes (where its scalars start)."""
    return -(-count * width * shard * itemsize // 8) * 8


def slot_need(count: int, width: int, shard: int, itemsize: int, nscalars: int) -> int:
    """The bytes one copy of `count` shards fills in a slot: rows, then scalars."""
    return rows_bytes(count, width, shard, itemsize) + count * nscalars * 8


def region_bytes(slot_bytes: int) -> int:
    return HEADER_BYTES + 2 * slot_bytes


def slot_offset(slot_bytes: int, index: int) -> int:
    """Where slot `index` starts within its region."""
    return HEADER_BYTES + index * slot_bytes


def word_index(slot: int, word: int) -> int:
    """The int64 index of slot `slot`'s header word `word` within its region's header."""
    return 4 + slot * SLOT_WORDS + word
