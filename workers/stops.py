"""Stop strings on streamed text, for engines that do not find them themselves."""

from __future__ import annotations

from collections.abc import Sequence


class StopScanner:
    """Finds the first stop string in text that arrives in pieces.

    What could still become a stop string is held back until the next piece tells, so no
    part of a stop string is ever sent; the stop string itself is not part of the output
    (as with OpenAI's API and vLLM).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(stops)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """The text that may be sent now, and whether a stop string ended the output."""
        held = self._held + text
        found = [at for stop in self._stops if (at := held.find(stop)) >= 0]
        if found:
            self._held = ""
            return held[: min(found)], True
        keep = self._partial_stop_length(held)
        self._held = held[len(held) - keep :]
        return held[: len(held) - keep], False

    def flush(self) -> str:
        """What was held back, once the output ended without a stop string."""
        held, self._held = self._held, ""
        return held

    def _partial_stop_length(self, text: str) -> int:
        """The length of the longest end of `text` that begins a stop string."""
        longest = max((len(stop) - 1 for stop in self._stops), default=0)
        for length in range(min(longest, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0
