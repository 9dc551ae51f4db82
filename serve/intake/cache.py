"""A bounded cache of prepared images, keyed by the hash of the client's encoded image.

Chat clients (the OpenAI SDK, Chainlit, LangChain, ...) re-send every earlier image of a
conversation on each turn, so without a cache a history image is decoded and checked again
every turn. With it, a repeated image costs one SHA-256 of its base64 text (~2 ms for a 3 MB
payload) and is forwarded as the very same bytes as before, which also keeps vLLM's own
multimodal processor cache hitting.

The key covers everything the prepared image depends on: the encoded bytes (their SHA-256)
and ``num_crops`` (the HD transform's target size). The image policy is fixed for a process.
Only successfully prepared images are cached; a refused image is checked again (cheaply: its
caps fail before decoding).

Thread-safe: the intake prepares images in worker threads.
"""

from __future__ import annotations

import collections
import hashlib
import threading

from serve.intake.images import PreparedImage


def image_key(encoded: str | bytes, num_crops: int) -> tuple[bytes, int]:
    """The cache key of an image given as its base64 text (``str``) or raw bytes."""
    data = encoded.encode() if isinstance(encoded, str) else encoded
    return hashlib.sha256(data).digest(), num_crops


class ImageCache:
    """LRU cache of :class:`PreparedImage` bounded by the bytes of their ``data:`` URLs.

    Args:
        max_bytes: most bytes of forwarded ``data:`` URLs held (0 disables the cache). An
            entry larger than a quarter of it is not stored, so one huge image cannot flush
            a conversation's worth of small ones.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[tuple[bytes, int], PreparedImage] = (
            collections.OrderedDict())
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return self._bytes

    def get(self, key: tuple[bytes, int]) -> PreparedImage | None:
        """The cached image for ``key`` (marked most recently used), or None."""
        with self._lock:
            image = self._entries.get(key)
            if image is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return image

    def put(self, key: tuple[bytes, int], image: PreparedImage) -> None:
        """Store ``image``, evicting least recently used entries over :attr:`max_bytes`."""
        size = image.nbytes
        if size > self.max_bytes // 4:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[key] = image
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
