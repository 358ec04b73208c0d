"""The responses kept for GET /v1/responses/{id} and `previous_response_id`: in memory, bounded, lost on
restart.

Each entry holds the response and its whole conversation as chat messages (the input it continued, its
own input and its output; never the `instructions`, which OpenAI does not carry over), so a continuation
needs no walk back through a chain whose older links may have been evicted. The least recently used
entries go first once there are more than `capacity`, or their conversations hold more than `max_chars`
characters in all."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from .protocol_responses import ResponseObject

# Defaults: a few hundred agent turns of a busy server, and a memory bound that holds whatever they are.
DEFAULT_CAPACITY = 1000
DEFAULT_MAX_CHARS = 64 * 1024 * 1024


@dataclass
class StoredResponse:
    response: ResponseObject
    conversation: list[dict]   # chat messages, as /v1/chat/completions takes them
    chars: int


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_chars: int = DEFAULT_MAX_CHARS):
        self.capacity, self.max_chars = capacity, max_chars
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0
        # Handlers run on one event loop; the lock keeps the store safe for a threaded caller too.
        self._lock = threading.Lock()

    def put(self, response: ResponseObject, conversation: list[dict]) -> None:
        chars = len(json.dumps(conversation, ensure_ascii=False))
        with self._lock:
            self._pop(response.id)
            self._entries[response.id] = StoredResponse(response, conversation, chars)
            self._chars += chars
            while self._entries and (len(self._entries) > self.capacity or self._chars > self.max_chars):
                self._pop(next(iter(self._entries)))

    def get(self, response_id: str) -> Optional[StoredResponse]:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._pop(response_id) is not None

    def _pop(self, response_id: str) -> Optional[StoredResponse]:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._chars -= entry.chars
        return entry

    def __len__(self) -> int:
        return len(self._entries)
