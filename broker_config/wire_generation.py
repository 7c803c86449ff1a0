"""What a request asks of an engine and what the engine reports back, as msgspec Structs.

Chat messages in, sampling parameters, each token's log probabilities out, and why the
output ended. They are part of the public contract (docs/protocol.md): wire.py nests
them in the submitted request and in the token and done events. Engines (workers/) use
only these, not the messages around them.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

# The largest value of the contract's integer fields (a signed 32-bit int's).
INT32_MAX = 2**31 - 1


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    role: str
    content: str


Probability = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
# Each stop string, and how many: OpenAI's API allows 4; engines take more.
StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
MAX_STOP_STRINGS = 16
# Alternatives per token a request may ask logprobs for (vLLM's and OpenAI's maximum).
MAX_TOP_LOGPROBS = 20


class Sampling(
    msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, frozen=True, kw_only=True
):
    """How to sample the output; every field optional, an absent one is the engine's
    default. Ranges are OpenAI's where it has the parameter.

    `logprobs`: how many alternatives to report beside each generated token's own log
    probability (0: the token's only). `n` is 1: events carry one sequence.
    """

    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)] | None = None  # 0: off
    min_p: Probability | None = None
    stop: Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOP_STRINGS)] = []
    seed: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=2.0)] | None = None
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=1)] = 1


class TopLogprob(msgspec.Struct, frozen=True):
    token: str
    logprob: float


class TokenLogprob(msgspec.Struct, frozen=True):
    """One generated token, its log probability, and the most likely alternatives (as
    many as the request's `sampling.logprobs`)."""

    token: str
    logprob: float
    top: list[TopLogprob] = []


FinishReason = Literal["stop", "length"]
