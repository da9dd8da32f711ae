"""Which replica serves a request: the one that holds its conversation, else the least loaded one.

A conversation's KV (and the replica's prefix cache of it) lives on one replica, so every turn of it must reach that
replica. The ingress cannot see inside a replica's cache; it routes by a key that every turn of a conversation
shares:

- an explicit session id (header `X-Session-ID`), when the client sends one;
- chat completions: the messages up to and including the first user message (each later turn repeats them);
- completions: the first PROMPT_KEY_CHARS characters of the prompt (a continuation repeats its document).

Keys map to replicas by rendezvous hashing over the replicas that are up: when one goes down only its conversations
move, and they move back when it returns. A request without a key, or whose replica is full, goes to the least-loaded
replica with room; with none, the ingress answers 503.

Pure Python: no Ray here, so the policy is tested without a cluster.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

PROMPT_KEY_CHARS = 256
SESSION_HEADER = "x-session-id"


def affinity_key(path: str, headers: Mapping[str, str], body: bytes) -> str | None:
    """The routing key of a request (None: route by load alone). headers: lower-case names."""
    session = headers.get(SESSION_HEADER, "").strip()
    if session:
        return "session:" + session
    if path not in ("/v1/chat/completions", "/v1/completions"):
        return None
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None  # the replica answers the 400
    if not isinstance(request, dict):
        return None
    if path == "/v1/chat/completions":
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        head = []
        for message in messages:
            head.append(message)
            if isinstance(message, dict) and message.get("role") == "user":
                break
        return "chat:" + json.dumps(head, sort_keys=True, ensure_ascii=False)
    prompt = request.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return "prompt:" + prompt[:PROMPT_KEY_CHARS]
    return None


def _weight(key: str, replica: int) -> int:
    """Rendezvous weight of (key, replica): the highest weight among live replicas wins."""
    digest = hashlib.blake2b(f"{replica}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass
class ReplicaState:
    index: int
    capacity: int  # requests the replica accepts at once (its batch plus its queue)
    in_flight: int = 0  # forwarded and not yet finished
    ready: bool = False  # its engine answered ready (set by the ingress's probe)
    down_until: float = 0.0  # monotonic time before which a failed replica gets no new request
    routed: int = 0
    failures: int = 0
    pid: int | None = None
    state: str = "starting"  # the replica's own word: starting, loading, ready, failed, down

    @property
    def up(self) -> bool:
        return self.ready and time.monotonic() >= self.down_until

    @property
    def has_room(self) -> bool:
        return self.in_flight < self.capacity


@dataclass
class Router:
    """The ingress's book of replicas: routing, in-flight counts, failures."""

    replicas: list[ReplicaState] = field(default_factory=list)
    rejected_full: int = 0  # 503s because every live replica was full
    rejected_down: int = 0  # 503s because no replica was up

    @classmethod
    def of(cls, n: int, capacity: int) -> Router:
        return cls([ReplicaState(i, capacity) for i in range(n)])

    def pick(self, key: str | None, exclude: set[int] | frozenset[int] = frozenset()) -> ReplicaState | None:
        """The replica for a request, or None (the reason counted in rejected_full / rejected_down)."""
        live = [r for r in self.replicas if r.up and r.index not in exclude]
        if not live:
            self.rejected_down += 1
            return None
        if key is not None:
            home = max(live, key=lambda r: _weight(key, r.index))
            if home.has_room:
                return home
        open_ = [r for r in live if r.has_room]
        if not open_:
            self.rejected_full += 1
            return None
        return min(open_, key=lambda r: (r.in_flight, r.index))

    def home_of(self, key: str) -> int | None:
        """The replica a key prefers among the live ones (routing aside from load)."""
        live = [r for r in self.replicas if r.up]
        return max(live, key=lambda r: _weight(key, r.index)).index if live else None

    def mark_failed(self, replica: ReplicaState, hold_s: float) -> None:
        """A call to the replica failed: no new requests for hold_s, and not before it answers ready again."""
        replica.failures += 1
        replica.ready = False
        replica.state = "down"
        replica.down_until = time.monotonic() + hold_s
