"""OpenAI's request and response shapes, and their translation to and from fairq's wire.

Requests are decoded leniently, as OpenAI-compatible servers do: fields this front does
not know are ignored, except those whose meaning it cannot honour (`tools`, `n` > 1,
remote image URLs, token-id prompts), which are refused with a 400 naming them. What
fairq itself checks (ranges of the sampling parameters, input limits) is left to the SDK
and the dispatcher, so a request is judged once, by the same rules as any client's. The
one exception is `max_tokens` over the endpoint's `max_tokens_cap`, which fairq lowers
silently: the front refuses it (400), as OpenAI and vLLM refuse a `max_tokens` over what
the model can generate, so that a caller never gets less than it asked without a word.
"""

from __future__ import annotations

import base64
import struct
import time
from typing import Any, Literal

import msgspec

from broker_config.wire import DoneEvent, ErrorEvent, Event, TokenEvent, TokenLogprob
from producers.openai_front.errors import FrontError, body_param, error_for

DATA_URL_PREFIX = "data:"
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's own limit


# -- requests ------------------------------------------------------------------------------


class FairqOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """fairq's own settings, in an optional `fairq` object beside OpenAI's fields."""

    priority: int | None = None
    deadline: float | None = None
    session: str | None = None
    metadata: dict[str, str] | None = None


class ContentPart(msgspec.Struct, frozen=True):
    type: str
    text: str | None = None
    image_url: dict[str, Any] | None = None


class Message(msgspec.Struct, frozen=True):
    role: str
    content: str | list[ContentPart] | None = None


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class _Common(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = None
    # Beside OpenAI's, as vLLM's OpenAI server takes them.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    fairq: FairqOptions | None = None
    user: str | None = None

    def param_names(self) -> dict[str, str]:
        """This request's names for the submit's fields, where they differ."""
        return {}


class ChatRequest(_Common, frozen=True, kw_only=True):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None

    def param_names(self) -> dict[str, str]:
        return {
            "max_tokens": "max_tokens"
            if self.max_completion_tokens is None
            else "max_completion_tokens",
            "logprobs": "top_logprobs",
            "prompt": "messages",
            "images": "messages",
        }


class CompletionRequest(_Common, frozen=True, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class EmbeddingRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    fairq: FairqOptions | None = None
    user: str | None = None

    def param_names(self) -> dict[str, str]:
        return {"prompt": "input"}


def decode_body(body: bytes, type_: type[Any]) -> Any:
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        raise FrontError(400, f"invalid body: {exc}", param=body_param(exc)) from exc
    except msgspec.DecodeError as exc:
        raise FrontError(400, f"body is not valid JSON: {exc}") from exc


def _refuse(param: str, why: str) -> FrontError:
    return FrontError(400, f"`{param}`: {why}", param=param, code="unsupported_parameter")


def _max_tokens(request: _Common, asked: int | None, cap: int) -> int | None:
    """`asked`, refused (400) over the endpoint's cap rather than lowered to it."""
    if asked is not None and asked > cap:
        param = request.param_names().get("max_tokens", "max_tokens")
        raise FrontError(
            400,
            f"`{param}` is {asked}, but model {request.model!r} generates at most {cap} "
            "tokens per request (its max_tokens_cap)",
            param=param,
            code="invalid_value",
        )
    return asked


def _sampling(request: _Common, logprobs: int | None) -> dict[str, Any]:
    if request.n not in (None, 1):
        raise _refuse("n", "only n = 1 is supported")
    stop = [request.stop] if isinstance(request.stop, str) else request.stop
    fields = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "stop": stop,
        "seed": request.seed,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "logprobs": logprobs,
    }
    return {name: value for name, value in fields.items() if value is not None}


def fairq_fields(options: FairqOptions | None) -> dict[str, Any]:
    if options is None:
        return {}
    return {
        name: value for name, value in msgspec.structs.asdict(options).items() if value is not None
    }


def chat_submit(request: ChatRequest, cap: int) -> dict[str, Any]:
    """The keywords of `Client.submit` for a chat completion on an endpoint of this
    `max_tokens_cap`."""
    if request.tools or request.functions:
        raise _refuse("tools", "tool calling is not supported")
    if request.top_logprobs is not None and not request.logprobs:
        raise _refuse("top_logprobs", "needs `logprobs: true`")
    messages, images = [], []
    for index, message in enumerate(request.messages):
        text, found = _content(message.content, f"messages[{index}].content")
        messages.append({"role": message.role, "content": text})
        images += found
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    max_tokens = (
        request.max_tokens
        if request.max_completion_tokens is None
        else request.max_completion_tokens
    )
    fields: dict[str, Any] = {
        "messages": messages,
        "max_tokens": _max_tokens(request, max_tokens, cap),
        "sampling": _sampling(request, logprobs) or None,
        **fairq_fields(request.fairq),
    }
    if images:
        fields["images"] = images
    return fields


def _content(content: str | list[ContentPart] | None, param: str) -> tuple[str, list[str]]:
    """A message's text and its images' base64 (data URLs only: the front fetches nothing)."""
    if content is None or isinstance(content, str):
        return content or "", []
    texts, images = [], []
    for part in content:
        if part.type == "text":
            texts.append(part.text or "")
        elif part.type == "image_url":
            url = str((part.image_url or {}).get("url", ""))
            head, comma, data = url.partition(",")
            if not (head.startswith(DATA_URL_PREFIX) and head.endswith(";base64") and comma):
                raise _refuse(param, "images must be data URLs (data:image/...;base64,...)")
            images.append(data)
        else:
            raise _refuse(param, f"content parts of type {part.type!r} are not supported")
    return "".join(texts), images


def completion_submit(request: CompletionRequest, cap: int) -> dict[str, Any]:
    prompt = request.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise _refuse("prompt", "one prompt string per request (no batches, no token ids)")
        prompt = prompt[0]
    if request.echo:
        raise _refuse("echo", "not supported")
    if request.suffix is not None:
        raise _refuse("suffix", "not supported")
    # OpenAI's legacy completions default to 16 tokens (fewer on an endpoint capped lower).
    return {
        "prompt": prompt,
        "max_tokens": min(16, cap)
        if request.max_tokens is None
        else _max_tokens(request, request.max_tokens, cap),
        "sampling": _sampling(request, request.logprobs) or None,
        **fairq_fields(request.fairq),
    }


def embedding_inputs(request: EmbeddingRequest) -> list[str]:
    inputs = [request.input] if isinstance(request.input, str) else request.input
    if not inputs or not all(isinstance(item, str) for item in inputs):
        raise _refuse("input", "a string or a non-empty list of strings (no token ids)")
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise _refuse("input", f"at most {MAX_EMBEDDING_INPUTS} inputs per request")
    if request.dimensions is not None:
        raise _refuse("dimensions", "the model's own size only")
    return inputs


# -- responses -----------------------------------------------------------------------------


def usage(done: DoneEvent) -> dict[str, int]:
    prompt, completion = done.usage.input_tokens, done.usage.output_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def chat_logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.token.encode()),
                "top_logprobs": [
                    {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())}
                    for t in e.top
                ],
            }
            for e in entries
        ]
    }


def completion_logprobs(
    entries: list[TokenLogprob] | None, offset: int = 0
) -> dict[str, Any] | None:
    if entries is None:
        return None
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


class ResponseIds:
    """The id, creation time and model every object of one response shares."""

    def __init__(self, prefix: str, request_id: str, model: str) -> None:
        self.id = f"{prefix}-{request_id}"
        self.created = int(time.time())
        self.model = model

    def head(self, object_: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}


def chat_completion(
    ids: ResponseIds, done: DoneEvent, logprobs: list[TokenLogprob] | None
) -> dict[str, Any]:
    return {
        **ids.head("chat.completion"),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": done.text},
                "logprobs": chat_logprobs(logprobs),
                "finish_reason": done.finish_reason or "stop",
            }
        ],
        "usage": usage(done),
    }


def text_completion(
    ids: ResponseIds, done: DoneEvent, logprobs: list[TokenLogprob] | None
) -> dict[str, Any]:
    return {
        **ids.head("text_completion"),
        "choices": [
            {
                "index": 0,
                "text": done.text,
                "logprobs": completion_logprobs(logprobs),
                "finish_reason": done.finish_reason or "stop",
            }
        ],
        "usage": usage(done),
    }


def embedding_list(model: str, dones: list[DoneEvent], encoding_format: str) -> dict[str, Any]:
    data = []
    for index, done in enumerate(dones):
        if done.embedding is None:
            raise FrontError(
                500,
                f"model {model!r} returned no embedding: is it an "
                'embedding endpoint (kind = "embed")?',
                type_="server_error",
            )
        vector: list[float] | str = done.embedding
        if encoding_format == "base64":
            vector = base64.b64encode(
                struct.pack(f"<{len(done.embedding)}f", *done.embedding)
            ).decode()
        data.append({"object": "embedding", "index": index, "embedding": vector})
    prompt = sum(done.usage.input_tokens for done in dones)
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
    }


class StreamChunks:
    """The server-sent chunks of one streamed completion (chat or legacy), as OpenAI
    sends them: a role first (chat), the text as it comes, then the finish reason, and
    the usage in a last chunk without choices when `stream_options.include_usage`.

    Token events are passed on in `seq` order, each once: a request that runs again (its
    worker thought lost) streams from 0 again, and its client must not get that text
    twice. Token events are at most once on the wire: if one was missed, the done event's
    text says what the client lacks; the rest of it is sent if what was sent begins it,
    else the stream ends with an error.
    """

    def __init__(self, ids: ResponseIds, *, chat: bool, include_usage: bool) -> None:
        self._ids = ids
        self._chat = chat
        self._include_usage = include_usage
        self._sent: list[str] = []
        self._offset = 0  # characters sent so far: legacy logprobs' text offsets
        self._next_seq = 0
        self.finished = False  # the request's final event has been turned into chunks

    def start(self) -> list[dict[str, Any]]:
        """The chunks before any text: chat's role (legacy completions have none)."""
        return [self._chunk({"role": "assistant", "content": ""})] if self._chat else []

    def of(self, event: Event) -> list[dict[str, Any]]:
        if isinstance(event, TokenEvent):
            if event.seq < self._next_seq:
                return []
            self._next_seq = event.seq + 1
            return [self._text(event.text, event.logprobs)]
        self.finished = True
        if isinstance(event, ErrorEvent):
            return [error_for(event.code, event.message).body()]
        assert isinstance(event, DoneEvent)
        sent = "".join(self._sent)
        if not event.text.startswith(sent):
            return [
                FrontError(
                    500,
                    f"the stream of request {event.id} missed some of its "
                    "text; its whole answer is in its result (fairq status)",
                    type_="server_error",
                ).body()
            ]
        chunks = [self._text(event.text[len(sent) :])] if len(event.text) > len(sent) else []
        chunks.append(self._chunk({}, finish_reason=event.finish_reason or "stop"))
        if self._include_usage:
            chunks.append({**self._head(), "choices": [], "usage": usage(event)})
        return chunks

    def _text(self, text: str, logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        chunk = self._chunk({"content": text}, text=text, logprobs=logprobs)
        self._sent.append(text)
        self._offset += len(text)
        return chunk

    def _head(self) -> dict[str, Any]:
        return self._ids.head("chat.completion.chunk" if self._chat else "text_completion")

    def _chunk(
        self,
        delta: dict[str, Any],
        *,
        text: str = "",
        logprobs: list[TokenLogprob] | None = None,
        finish_reason: str | None = None,
    ) -> dict[str, Any]:
        if self._chat:
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": chat_logprobs(logprobs),
                "finish_reason": finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": completion_logprobs(logprobs, self._offset),
                "finish_reason": finish_reason,
            }
        chunk = {**self._head(), "choices": [choice]}
        if self._include_usage:
            chunk["usage"] = None
        return chunk
