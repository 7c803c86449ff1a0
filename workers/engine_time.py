"""Engine time a worker attributes to its requests when the engine does not say.

The cost unit is engine time at the operating point (docs/architecture.md, "The cost
unit"), and fairness is judged in it. The simulated engine reports each request's exact
share of its steps (`Delta.engine_s`); vLLM reports nothing per request. For an engine
that does not say, the worker measures it from what it sees of its own engine and the
profile's calibrated curve:

- the prefill, once: `alpha * (input - cached) + gamma * images` (a cached prefix is not
  computed again, so it takes no engine time, whatever discount the price gives it);
- every output token: `profile.decode_token_s(n)`, where n counts the requests decoding
  on this engine when the token arrives, itself included: those that emitted a token and
  have not ended. Those are the sequences sharing the decode step that produced it;
  requests still waiting or prefilling emit nothing in it and pay no share.

Only a profile with a batched curve measures anything: with a flat one (no
`decode_base_s`) occupancy changes nothing, and the dispatcher's price of the real usage
by the profile is the measurement already. Unmeasured is 0 on the wire.

Probes run outside the requests' accounting (workers/probe.py) and are not counted in n:
one short sequence now and then.
"""

from __future__ import annotations

from collections.abc import Iterable

from costmodel.units import ModelProfile


def measures(profile: ModelProfile | None) -> bool:
    """Whether the profile's curve makes a measured engine time worth reporting."""
    return profile is not None and (profile.decode_base_s or 0.0) > 0


def decode_engine_s(profile: ModelProfile, emissions: Iterable[tuple[int, int]]) -> float:
    """Engine seconds of output tokens emitted as `(tokens, occupancy)` pairs: each token
    pays its share of a decode step of `occupancy` sequences."""
    return sum(count * profile.decode_token_s(occupancy) for count, occupancy in emissions)


def prefill_engine_s(
    profile: ModelProfile, input_tokens: int, cached_input_tokens: int, images: int
) -> float:
    """Engine seconds of a request's prefill and image encoding."""
    computed = input_tokens - min(max(cached_input_tokens, 0), input_tokens)
    return profile.alpha * computed + profile.gamma * images


class EngineTimeMeter:
    """The worker's view of one engine's decode batch, and each token's share of it.

    `emitted` when a request's output tokens arrive, `ended` when its stream closes;
    `engine_s` adds the prefill once the request's counts are final.
    """

    def __init__(self, profile: ModelProfile | None) -> None:
        self._profile = profile if measures(profile) else None
        # Keys of the requests that emitted a token and whose stream is still open.
        self._decoding: set[str] = set()

    @property
    def measuring(self) -> bool:
        return self._profile is not None

    @property
    def occupancy(self) -> int:
        """Requests decoding on the engine now."""
        return len(self._decoding)

    def emitted(self, key: str, tokens: int) -> float:
        """Engine seconds of `tokens` output tokens request `key` just emitted (0 when
        not measuring)."""
        if self._profile is None or tokens <= 0:
            return 0.0
        self._decoding.add(key)
        return decode_engine_s(self._profile, ((tokens, len(self._decoding)),))

    def ended(self, key: str) -> None:
        """Request `key` left the engine: later tokens of others share steps without it."""
        self._decoding.discard(key)

    def engine_s(
        self, decode_s: float, input_tokens: int, cached_input_tokens: int, images: int
    ) -> float:
        """A request's whole attributed engine time: its decode seconds (the sum of what
        `emitted` returned for it) plus its prefill; 0 when not measuring."""
        if self._profile is None:
            return 0.0
        return decode_s + prefill_engine_s(self._profile, input_tokens, cached_input_tokens, images)
