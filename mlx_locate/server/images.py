"""The images a server holds for its calls, within a byte budget (`--max-image-mb`).

An image arrives compressed. Its header is read at once (format and size checked, no pixel decoded) and its
compressed bytes are charged to the budget (`ImageBudget.admit`). It is decoded only when the budget also holds
its decoded size (`decoded_bytes`), in arrival order (`Holding.turn`), and both charges stay until its call ends
(`Holding.release`, which also frees the decoded pixels). Decoded images take at most half the budget (one
larger image goes alone), so calls that arrive meanwhile wait compressed in the other half. A call that would
put the held bytes over the budget now is refused (`QueueFull`: 503 with Retry-After), one that could never fit
(`TooLarge`: 400). Admission keeps room for the largest waiting image's decoded size beside the compressed bytes
of all waiting ones, so the first in line is always decoded once the calls before it end.

What a finished call leaves in reference cycles (the engine's handles and their events) waits for Python's
garbage collector, and freed buffers stay in glibc's malloc arenas: so whenever the budget empties, and after
each budget's worth of released bytes, the collector runs and glibc is asked to return free memory (`trim`).

No MLX and no web framework here: the handlers use it, tests and the load benchmark read its numbers.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import math
import threading
from collections import deque
from functools import cache

from PIL import Image

from ..preprocess import target_size
from .worker import QueueFull, TooLarge

CLEAN_AFTER = 64 << 20  # bytes released since the last clean-up that make an empty budget clean up again


def decoded_bytes(size: tuple[int, int], mode: str, in_token_limit: int, patch: int, views: int = 1) -> int:
    """About the most bytes decoding and preparing an image of `size` pixels in Pillow `mode` holds: Pillow keeps
    4 bytes a pixel, once more for the image policy's turned or sRGB copy and once more for a mode other than RGB
    (its RGB copy); a tiled call's crops cover the image about
    twice; each of its `views` keeps its patches (3 bytes a pixel of the model's resized image) and, while it is
    prepared, makes its resized copy (4 bytes a pixel), its pixel array and its hashed bytes (3 each)."""
    w, h = size
    held = 4 * w * h * (2 if mode == "RGB" else 3)
    try:
        resized = math.prod(target_size(w, h, in_token_limit, patch).final)
    except ValueError:  # a size the engine refuses (and reports): nothing is resized
        resized = 0
    if views > 1:
        held += 8 * w * h
        resized = min(w * h, in_token_limit * patch * patch)  # a view's resized image, at most
    return held + (3 * views + 10) * resized


class Holding:
    """One call's charge on an `ImageBudget`: its compressed bytes from admission, its decoded bytes from its
    turn, until `release` (idempotent), which also frees the pixels of `image` (Pillow's `close`) whoever still
    refers to it."""

    def __init__(self, budget: ImageBudget, compressed: int, decoded: int, loop: asyncio.AbstractEventLoop):
        self.budget, self.compressed, self.decoded = budget, compressed, decoded
        self.granted = loop.create_future()
        self.released = False
        self.image: Image.Image | None = None  # the decoded image, once it is

    async def turn(self) -> None:
        """Wait until the budget holds this image's decoded size too (in arrival order); a cancelled wait
        releases the charge."""
        try:
            await asyncio.shield(self.granted)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        if self.image is not None:
            self.image.close()
            self.image = None
        self.budget._release(self)


class ImageBudget:
    """Bytes of images held by the server's calls, at most `max_bytes` (see the module's docstring).
    Thread-safe; a waiting `Holding` is woken on the event loop that admitted it."""

    def __init__(self, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"the image budget must be at least 1 byte, got {max_bytes}")
        self.max_bytes = max_bytes
        self.held = 0  # bytes charged now
        self.decoding = 0  # of which decoded bytes
        self.peak = 0  # the most bytes charged at once
        self.admitted = 0  # calls admitted
        self.refused = 0  # calls refused with QueueFull
        self.cleanups = 0
        self._released = 0  # bytes released since the last clean-up
        self._lock = threading.Lock()
        self._line: deque[Holding] = deque()  # admitted, waiting for their decode turn

    @property
    def waiting(self) -> int:
        return len(self._line)

    def admit(self, compressed: int, decoded: int) -> Holding:
        """Charge a call's compressed bytes now (call from its event loop); `TooLarge` when its bytes exceed the
        budget, `QueueFull` when it does not fit now."""
        mb = self.max_bytes / 2**20
        if compressed + decoded > self.max_bytes:
            raise TooLarge(
                f"the image needs about {(compressed + decoded) / 2**20:,.0f} MB decoded; the server holds at most "
                f"{mb:,.0f} MB of images (--max-image-mb), so it can never run here: send a smaller image"
            )
        holding = Holding(self, compressed, decoded, asyncio.get_running_loop())
        with self._lock:
            waiting = compressed + sum(h.compressed for h in self._line)
            widest = max([decoded, *(h.decoded for h in self._line)])
            if self.held + compressed > self.max_bytes or waiting + widest > self.max_bytes:
                self.refused += 1
                raise QueueFull(
                    f"the server holds {self.held / 2**20:,.0f} of {mb:,.0f} MB of images (--max-image-mb) and "
                    f"this one needs {(compressed + decoded) / 2**20:,.0f} MB; retry shortly"
                )
            self.admitted += 1
            self._charge(compressed)
            self._line.append(holding)
            self._grant()
        return holding

    def _charge(self, n: int) -> None:
        self.held += n
        self.peak = max(self.peak, self.held)

    def _grant(self) -> None:
        """Give their turn to the first in line while their decoded bytes fit, within half the budget unless
        nothing else is decoded (under the lock)."""
        while self._line:
            holding = self._line[0]
            half = self.decoding == 0 or self.decoding + holding.decoded <= self.max_bytes // 2
            if not half or self.held + holding.decoded > self.max_bytes:
                return
            self._line.popleft()
            self._charge(holding.decoded)
            self.decoding += holding.decoded
            try:
                holding.granted.get_loop().call_soon_threadsafe(_set_granted, holding.granted)
            except RuntimeError:  # its loop is closed: nobody waits for it
                pass

    def _release(self, holding: Holding) -> None:
        with self._lock:
            if holding.released:
                return
            holding.released = True
            freed = holding.compressed
            if holding in self._line:
                self._line.remove(holding)
            else:
                freed += holding.decoded
                self.decoding -= holding.decoded
            self.held -= freed
            self._released += freed
            self._grant()
            clean = self._released >= self.max_bytes or (self.held == 0 and self._released >= CLEAN_AFTER)
            if clean:
                self._released = 0
                self.cleanups += 1
        if clean:
            gc.collect()
            trim()


def _set_granted(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


@cache
def _malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has none (macOS returns large blocks by itself)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (AttributeError, OSError, TypeError):
        return None


def trim() -> bool:
    """Return the free memory of the C library's heaps to the system: after a burst of large images the freed
    buffers otherwise stay in the process's malloc arenas. False where there is no `malloc_trim`."""
    malloc_trim = _malloc_trim()
    return malloc_trim is not None and bool(malloc_trim(0))
