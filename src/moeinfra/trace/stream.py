"""Split a Chrome-trace JSON byte stream, read in bounded chunks, into batches of whole events.

:func:`scan_trace` reads the file's bytes chunk by chunk and yields

- ``("events", data, offset, bare)``: ``data`` is a JSON array (``[e1, e2, ...]``, a ``bytearray``)
  holding the next complete elements of ``traceEvents`` (or, ``bare``, of a top-level array);
  ``offset`` is the position in the file of ``data[1]``, so a decoder's byte ``b`` is at
  ``offset + b - 1``;
- ``("member", key, raw)`` for every other top-level member, in file order: ``raw`` is
  ``b'"key":value'`` as written, or ``None`` when the value was longer than ``cap`` bytes and
  ``key`` is not in ``keep`` (such a value is skipped, not held).

Memory is bounded by the chunk plus the longest event; the whole file is never held. Finding where
an event ends needs the string state (with ``\\``-escapes) and the bracket depth of every bracket:
numpy computes them for a whole chunk at once; Python walks only the few top-level tokens and cuts
each chunk once, after the last event that ends in it. Commas and colons are looked for only at
the top level (outside ``traceEvents``). The events themselves are validated by whoever decodes
them; brackets are only counted here (``[}`` inside an event is left to the decoder).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterator

import msgspec
import numpy as np

_WS = re.compile(rb"[ \t\n\r]*")
_OPEN_COMMA = re.compile(rb"\[[ \t\n\r]*,")
_QUOTE, _BACKSLASH, _COMMA, _COLON = 34, 92, 44, 58
_OPEN, _CLOSE = 123, 125  # "{" / "}"; "[" / "]" map onto them with | 0x20
_PAIRS = {ord("{"): ord("}"), ord("["): ord("]")}
EVENTS_KEY = "traceEvents"


class ScanError(ValueError):
    """The bytes are not a JSON object with a ``traceEvents`` array, nor a JSON array."""


def _is_ws(data: bytes | memoryview) -> bool:
    return _WS.fullmatch(data) is not None  # type: ignore[arg-type]


def _unescaped_quotes(chunk: bytes, a: np.ndarray, escaped_first: bool) -> tuple[np.ndarray, bool]:
    """Positions of the ``"`` in ``a`` (``chunk`` as uint8) not escaped by a backslash, and whether
    the byte after ``a`` is escaped (``a`` ends in an odd run of backslashes). ``escaped_first``:
    ``a[0]`` is escaped."""
    quotes = np.flatnonzero(a == _QUOTE)
    if not escaped_first and b"\\" not in chunk:  # the usual case, found at memchr speed
        return quotes, False
    backslashes = np.flatnonzero(a == _BACKSLASH)
    if escaped_first:
        backslashes = np.concatenate(([-1], backslashes))  # the carried backslash, one byte before
    if not len(backslashes):
        return quotes, False
    # Runs of consecutive backslashes: a quote right after an odd run is escaped.
    breaks = np.flatnonzero(np.diff(backslashes) != 1)
    last = np.concatenate((breaks, [len(backslashes) - 1]))
    first = np.concatenate(([0], breaks + 1))
    run_end = backslashes[last]
    odd = (last - first) % 2 == 0
    if len(quotes):
        i = np.minimum(np.searchsorted(run_end, quotes - 1), len(run_end) - 1)
        quotes = quotes[~((run_end[i] == quotes - 1) & odd[i])]
    return quotes, bool(run_end[-1] == len(a) - 1 and odd[-1])


class _Scanner:
    """State carried from one chunk to the next (see :func:`scan_trace`)."""

    def __init__(self, keep: Collection[str], cap: int) -> None:
        self.keep, self.cap = keep, cap
        self.pos = 0  # file offset of the current chunk
        self.in_string = False
        self.escaped = False  # the next chunk's first byte is escaped
        self.depth = 0
        self.mode = "start"  # start -> object | array -> done
        self.top = 0  # deepest level of top-level tokens: 1 in an object, 0 in a bare array
        self.stack: list[int] = []  # openers ({ or [) of the levels <= top + 1
        # the text being captured: a member's key, then its value (None: not capturing)
        self.cap_parts: list[bytes] = []
        self.cap_from: int | None = None
        self.cap_size = 0
        self.dropped = False
        self.key: str | None = None
        self.key_raw = b""
        self.members = 0
        self.events_value = False  # the current member is traceEvents, streamed as events
        # the traceEvents array while inside it: events depth, start of the pending segment
        self.events_depth: int | None = None
        self.seg_parts: list[bytes] = []
        self.seg_from = 0
        self.seg_offset = 0  # file offset of the pending segment's first byte
        self.seg_after_cut = False  # the pending segment starts after an event: a comma is due

    # --- capture of top-level text -----------------------------------------------------------
    def _cap_begin(self, at: int) -> None:
        self.cap_parts, self.cap_from, self.cap_size, self.dropped = [], at, 0, False

    def _cap_take(self, chunk: memoryview, upto: int) -> None:
        """Move chunk bytes ``[cap_from, upto)`` (file offsets) into the capture."""
        if self.cap_from is None or self.dropped:
            return
        part = bytes(chunk[self.cap_from - self.pos : upto - self.pos])
        self.cap_from = upto
        self.cap_size += len(part)
        limited = self.key is not None and self.key not in self.keep
        if limited and self.cap_size > self.cap:
            self.cap_parts, self.dropped = [], True  # too long to keep: skipped
        else:
            self.cap_parts.append(part)

    def _cap_end(self, chunk: memoryview, at: int) -> bytes | None:
        self._cap_take(chunk, at)
        self.cap_from = None
        return None if self.dropped else b"".join(self.cap_parts)

    # --- the events array ---------------------------------------------------------------------
    def _segment(self, chunk: memoryview, upto: int, final: bool) -> tuple | None:
        """The pending events up to file offset ``upto`` as an ``events`` item (None if empty)."""
        parts = [*self.seg_parts, chunk[self.seg_from - self.pos : upto - self.pos]]
        data = bytearray(2 + sum(len(p) for p in parts))  # one allocation of the exact size
        data[0], data[-1], at = ord("["), ord("]"), 1
        for part in parts:
            data[at : at + len(part)] = part
            at += len(part)
        del parts
        offset, after_cut = self.seg_offset, self.seg_after_cut
        self.seg_parts, self.seg_from, self.seg_offset = [], upto, upto
        self.seg_after_cut = True
        if after_cut:  # the segment starts right after an event: "," and more events, or the end
            if final and _is_ws(memoryview(data)[1:-1]):
                return None
            match = _OPEN_COMMA.match(data)
            if match is None:
                raise ScanError(f"expected ',' or ']' after an event at byte {offset}")
            data[match.end() - 1] = 32  # that comma becomes a space: offsets stay as in the file
        if _is_ws(memoryview(data)[1:-1]):
            if after_cut:
                raise ScanError(f"trailing ',' after the last event at byte {offset}")
            return None
        return ("events", data, offset, self.mode == "array")

    # --- one chunk ----------------------------------------------------------------------------
    def feed(self, chunk: bytes) -> list[tuple]:
        """The items that ``chunk`` completes (its temporary arrays are freed on return)."""
        return list(self._feed(chunk))

    def _feed(self, chunk: bytes) -> Iterator[tuple]:
        view = memoryview(chunk)
        n = len(chunk)
        end = self.pos + n
        if self.mode == "done":
            if not _is_ws(view):
                raise ScanError(f"unexpected data after the top-level value at byte {self.pos}")
            self.pos = end
            return
        a = np.frombuffer(chunk, dtype=np.uint8)
        quotes, escaped_next = _unescaped_quotes(chunk, a, self.escaped)
        lower = a | 0x20
        brackets = np.flatnonzero((lower == _OPEN) | (lower == _CLOSE))
        if len(brackets):
            outside = ((np.searchsorted(quotes, brackets) + self.in_string) & 1) == 0
            brackets = brackets[outside]
        delta = np.where(lower[brackets] == _OPEN, 1, -1)
        after = self.depth + np.cumsum(delta)
        before = after - delta

        if self.mode == "start":
            first = _WS.match(view).end()  # type: ignore[union-attr]
            if first < n:
                char = chunk[first]
                if char not in b"{[":
                    raise ScanError(
                        f"expected an object with {EVENTS_KEY} or an array of events, "
                        f"got {chr(char)!r} at byte {self.pos + first}"
                    )
                self.mode = "object" if char == ord("{") else "array"
                self.top = 1 if self.mode == "object" else 0

        tokens = np.flatnonzero(np.minimum(before, after) <= self.top)
        token_pos = (brackets[tokens] + self.pos).tolist()
        token_after = after[tokens].tolist()
        token_char = a[brackets[tokens]].tolist()
        level = self.depth  # depth of the text between tokens
        cursor = self.pos  # file offset up to which the text has been walked
        for at, depth_after, char in zip(token_pos, token_after, token_char, strict=True):
            if self.mode == "done":
                raise ScanError(f"unexpected data after the top-level value at byte {at}")
            if level <= self.top and self.mode == "object":
                yield from self._members(chunk, a, quotes, cursor, at)
            yield from self._bracket(view, at, level, depth_after, char)
            level, cursor = depth_after, at + 1
        if level <= self.top and self.mode == "object":
            yield from self._members(chunk, a, quotes, cursor, end)
        elif self.mode == "done" and not _is_ws(view[cursor - self.pos :]):
            raise ScanError(f"unexpected data after the top-level value at byte {cursor}")

        if self.events_depth is not None:  # cut after the last event that ends in this chunk
            lo = np.searchsorted(brackets, max(self.seg_from - self.pos, 0))
            ends = np.flatnonzero((after[lo:] == self.events_depth) & (delta[lo:] < 0))
            if len(ends):
                cut = int(brackets[lo + ends[-1]]) + 1 + self.pos
                item = self._segment(view, cut, final=False)
                if item is not None:
                    yield item
            self.seg_parts.append(bytes(view[self.seg_from - self.pos :]))
            self.seg_from = end
        if self.cap_from is not None:
            self._cap_take(view, end)
        if len(after):
            self.depth = int(after[-1])
        self.in_string = bool((self.in_string + len(quotes)) & 1)
        self.escaped = escaped_next
        self.pos = end

    def _bracket(self, view: memoryview, at: int, level: int, depth_after: int, char: int):
        """A bracket at the top levels (file offset ``at``), the text before it at depth ``level``."""
        if depth_after > level:  # an opener
            self.stack.append(char)
            if level == 0:
                if self.mode == "array":
                    self._events_begin(at, 1)
                else:
                    self.members = 0
                    self._cap_begin(at + 1)  # the first key
            elif (
                self.key == EVENTS_KEY
                and char == ord("[")
                and self.cap_from is not None
                and not self.dropped
                and _is_ws(
                    b"".join(self.cap_parts) + bytes(view[self.cap_from - self.pos : at - self.pos])
                )
            ):
                self.cap_from = None
                self.events_value = True
                self._events_begin(at, 2)
            return
        if depth_after < 0:
            raise ScanError(f"unbalanced {chr(char)!r} at byte {at}")
        opener = self.stack.pop()
        if _PAIRS[opener] != char:
            raise ScanError(f"{chr(opener)!r} closed by {chr(char)!r} at byte {at}")
        if self.events_depth is not None and depth_after == self.events_depth - 1:
            item = self._segment(view, at, final=True)
            self.events_depth = None
            if item is not None:
                yield item
            if self.mode == "array":
                self.mode = "done"
            else:
                self._cap_begin(at + 1)  # what follows the array must be white space
            return
        if depth_after == 0:
            yield from self._member_end(view, at)
            self.mode = "done"

    def _events_begin(self, at: int, depth: int) -> None:
        self.events_depth = depth
        self.seg_parts, self.seg_from, self.seg_offset = [], at + 1, at + 1
        self.seg_after_cut = False

    def _members(self, chunk: bytes, a: np.ndarray, quotes: np.ndarray, lo: int, hi: int):
        """Commas and colons outside strings in file offsets ``[lo, hi)``, at the object's level."""
        if hi <= lo:
            return
        part = a[lo - self.pos : hi - self.pos]
        found = np.flatnonzero((part == _COMMA) | (part == _COLON)) + (lo - self.pos)
        if not len(found):
            return
        outside = ((np.searchsorted(quotes, found) + self.in_string) & 1) == 0
        view = memoryview(chunk)
        for i in found[outside].tolist():
            at = i + self.pos
            if chunk[i] == _COLON:
                if self.key is not None or self.cap_from is None:
                    raise ScanError(f"unexpected ':' at byte {at}")
                raw = self._cap_end(view, at)
                text = (raw or b"").strip(b" \t\n\r")
                try:
                    self.key = msgspec.json.decode(text, type=str)
                except Exception:
                    raise ScanError(f"expected a string key before byte {at}") from None
                self.key_raw = text
                self._cap_begin(at + 1)
            else:
                yield from self._member_end(view, at)
                self._cap_begin(at + 1)

    def _member_end(self, view: memoryview, at: int):
        """The member that ends at file offset ``at`` (a ``,`` or the object's ``}``)."""
        value = self._cap_end(view, at) if self.cap_from is not None else None
        key, self.key = self.key, None
        if key is None:
            if self.members or not _is_ws(value or b"") or chr(view[at - self.pos]) == ",":
                raise ScanError(f"expected a key before byte {at}")
            return
        self.members += 1
        if self.events_value:
            self.events_value = False
            if value is None or not _is_ws(value):
                raise ScanError(f"unexpected data after the {EVENTS_KEY} array before byte {at}")
            return
        if value is not None and _is_ws(value):
            raise ScanError(f"missing value of {key!r} before byte {at}")
        yield ("member", key, None if value is None else self.key_raw + b":" + value)


def scan_trace(
    read: Callable[[int], bytes],
    chunk_bytes: int = 4 << 20,
    keep: Collection[str] = (),
    cap: int = 1 << 20,
) -> Iterator[tuple]:
    """Split the trace JSON that ``read`` returns into ``events`` and ``member`` items (see the
    module docstring).

    Args:
        read: ``read(n)`` returns the next at most ``n`` bytes, ``b""`` at the end (a binary file's
            ``read``).
        chunk_bytes: bytes asked of ``read`` at a time.
        keep: top-level keys whose values are returned whatever their length.
        cap: longest value (bytes) returned for other keys; longer ones give ``raw=None``.

    Raises:
        ScanError: the text is not a JSON object or array as described, or is truncated (the
            message then says "truncated").
    """
    scanner = _Scanner(keep, cap)
    while chunk := read(chunk_bytes):
        items = scanner.feed(chunk)
        del chunk  # neither the chunk nor a yielded item stays referenced from here
        items.reverse()
        while items:
            yield items.pop()
    if scanner.mode != "done":
        where = "empty input" if scanner.mode == "start" else f"at byte {scanner.pos}"
        raise ScanError(f"Input data was truncated ({where})")
