"""Stop strings over streamed text: emit what is safe, hold back what may start a stop string."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Finds the first stop string in a text stream that arrives in arbitrary pieces.

    push() returns (text safe to emit now, whether a stop string was hit). On a hit the text
    ends just before the stop string and every later push returns ("", True). A suffix that
    could be the beginning of a stop string is held back until the next piece decides it.
    """

    def __init__(self, stop_strings: Sequence[str]):
        if isinstance(stop_strings, str):
            stop_strings = [stop_strings]  # a bare string is one stop, not one per character
        for stop in stop_strings:
            if not isinstance(stop, str) or not stop:
                raise ValueError(
                    f"invalid stop string {stop!r}: stop strings must be non-empty text; "
                    "remove it from 'stop'"
                )
        self.stop_strings = tuple(dict.fromkeys(stop_strings))
        self._held = ""
        self.is_stopped = False
        self.matched: str | None = None  # the stop string that ended the stream

    def push(self, text: str) -> tuple[str, bool]:
        """Feed the next piece of text; return (text to emit, stopped)."""
        if self.is_stopped:
            return "", True
        if not self.stop_strings:
            return text, False
        window = self._held + text
        hit_at, hit = self._first_hit(window)
        if hit is not None:
            self.is_stopped = True
            self.matched = hit
            self._held = ""
            return window[:hit_at], True
        keep = self._longest_partial_suffix(window)
        self._held = window[len(window) - keep:] if keep else ""
        return window[:len(window) - keep], False

    def flush(self) -> str:
        """End of stream: the held-back text was not a stop string after all."""
        held, self._held = self._held, ""
        return "" if self.is_stopped else held

    def _first_hit(self, window: str) -> tuple[int, str | None]:
        # The earliest position wins; at one position the shortest stop string cuts first.
        best_at, best = len(window) + 1, None
        for stop in self.stop_strings:
            at = window.find(stop)
            if at != -1 and (at < best_at or (at == best_at and len(stop) < len(best))):
                best_at, best = at, stop
        return best_at, best

    def _longest_partial_suffix(self, window: str) -> int:
        """Length of the longest suffix of window that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop_strings:
            for length in range(min(len(stop) - 1, len(window)), longest, -1):
                if window.endswith(stop[:length]):
                    longest = length
                    break
        return longest
