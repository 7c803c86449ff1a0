"""Input tokens counted by the dispatcher, with an endpoint's own tokenizer.

Admission charges rate limits and quotas by a request's input tokens before any engine
has seen it. A count the client declares can be a lie; where the endpoint names a
tokenizer (`[endpoints.X] tokenizer`, a Hugging Face `tokenizer.json`), the dispatcher
counts instead. Each tokenizer is loaded once, at start; inputs longer than
INLINE_CHARS are counted in a thread (the Rust tokenizer releases the GIL), so one huge
prompt does not stall the event loop. Chat messages are counted as their contents
joined, without the model's chat template: the engine's real count, a few template
tokens more, settles the difference on completion (dispatcher.core.limits).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from tokenizers import Tokenizer

from broker_config import wire
from broker_config.config import ConfigError, Endpoint
from dispatcher.dispatch.convert import prompt_text

# Below this many characters counting takes well under a millisecond: inline is cheaper
# than a thread hop.
INLINE_CHARS = 4096


class TokenizerError(ConfigError):
    """An endpoint's tokenizer file that cannot be loaded: the dispatcher cannot start."""


class InputCounter:
    def __init__(self, endpoints: Mapping[str, Endpoint]) -> None:
        self._tokenizers = {
            name: _load(name, spec.tokenizer) for name, spec in endpoints.items() if spec.tokenizer
        }

    async def count(self, endpoint: str, body: wire.SubmitRequest) -> int | None:
        """The input's tokens by the endpoint's tokenizer; None when it has none."""
        tokenizer = self._tokenizers.get(endpoint)
        if tokenizer is None:
            return None
        text = prompt_text(body)
        if len(text) <= INLINE_CHARS:
            return _count(tokenizer, text)
        return await asyncio.to_thread(_count, tokenizer, text)


def _load(endpoint: str, path: str) -> Tokenizer:
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as exc:  # the library raises bare Exceptions for unreadable files
        raise TokenizerError(
            f"field `endpoints.{endpoint}.tokenizer`: cannot load {path!r}: {exc}"
        ) from exc
    # A tokenizer.json saved for training may truncate or pad: either would miscount.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _count(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text).ids)
