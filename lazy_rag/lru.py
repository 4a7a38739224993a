"""A byte-bounded LRU map (the engine's host tier of chunk KV)."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

V = TypeVar("V")


class ByteLRU(Generic[V]):
    def __init__(self, max_bytes: int, size_of: Callable[[V], int]):
        self.max_bytes = int(max_bytes)
        self.size_of = size_of
        self._items: OrderedDict[Hashable, V] = OrderedDict()
        self.bytes = 0
        self.evictions = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def put(self, key: Hashable, value: V) -> None:
        size = self.size_of(value)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= self.size_of(old)
            if size > self.max_bytes:
                return  # larger than the whole budget: serve it, do not keep it
            self._items[key] = value
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, evicted = self._items.popitem(last=False)
                self.bytes -= self.size_of(evicted)
                self.evictions += 1

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.bytes = 0
