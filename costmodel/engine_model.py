"""A step-based timing model of a continuous-batching inference engine.

Pure and clock-free: `step()` says how long one engine iteration takes and what it
produced, and the caller advances its own clock (virtual in the simulator, real sleeps in
the simulated worker engine).

One iteration runs, in a mixed batch:
- prefill chunks for sequences still in prefill, in admission order, up to
  `max_batched_tokens` input tokens in total (chunked prefill); a sequence's images are
  encoded in the step its prefill starts, and it emits its first output token in the step
  its prefill completes;
- one decode token for every sequence whose prefill completed in an earlier step.

    duration = prefill_tokens / prefill_tokens_per_s + images * image_s
               + decode_step_base_s + decode_step_per_seq_s * n   (if n > 0)

where n counts the sequences emitting a token this step (first tokens and decode tokens).

A request alone therefore takes exactly

    input / prefill_tokens_per_s + images * image_s + output * (base + per_seq)

Batching amortises `decode_step_base_s` over the batch. `calibrate` recovers the model
from outside: one-token requests alone give alpha = 1 / prefill_tokens_per_s and gamma =
image_s as slopes, and identical requests decoding together at several batch sizes give
the curve (`engine_time_profile` is the exact result).

Attribution: every step's duration is split over the sequences in it, by the model's
own terms: the prefill part in proportion to each sequence's prefill tokens in the step,
the image part per image, and the decode part evenly over the n sequences that emit a
token. A sequence's engine time (`StepResult.engine_s` when it finishes, `engine_s()`
while it runs) is what it was attributed; over all sequences it adds up to the steps'
durations. This is the unit fairness is judged in (docs/architecture.md).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from costmodel.units import ModelProfile, read_toml

SeqId = Hashable


class EngineParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Engine limits and timing; the defaults are roughly a 7B model on one mid-range GPU.

    They match the `llama-7b-sim` profile in configs/example.toml.
    """

    # Sequences running at once (prefilling or decoding).
    max_sequences: int = 64
    # Input tokens prefilled per step, over all sequences (the chunked-prefill budget).
    max_batched_tokens: int = 4096
    # KV-cache size in tokens; a sequence reserves input + output tokens while it runs.
    kv_cache_tokens: int = 131072
    prefill_tokens_per_s: float = 8000.0
    # A decode step costs base + per_seq * (sequences emitting a token in the step);
    # base + per_seq = 0.025 s is the example profile's beta.
    decode_step_base_s: float = 0.0247
    decode_step_per_seq_s: float = 0.0003
    # Vision encoding, per image.
    image_s: float = 0.05

    def __post_init__(self) -> None:
        for name in ("max_sequences", "max_batched_tokens", "kv_cache_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine {name} must be >= 1, got {getattr(self, name)!r}")
        if not (self.prefill_tokens_per_s > 0 and math.isfinite(self.prefill_tokens_per_s)):
            raise ValueError(
                "engine prefill_tokens_per_s must be finite and > 0, "
                f"got {self.prefill_tokens_per_s!r}"
            )
        for name in ("decode_step_base_s", "decode_step_per_seq_s", "image_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"engine {name} must be finite and >= 0, got {value!r}")

    @property
    def alpha(self) -> float:
        """Seconds per input token of a request alone: what calibration recovers."""
        return 1.0 / self.prefill_tokens_per_s

    @property
    def beta(self) -> float:
        """Seconds per output token of a request alone (a decode step of one sequence)."""
        return self.decode_step_base_s + self.decode_step_per_seq_s

    @property
    def gamma(self) -> float:
        """Seconds per image of a request alone."""
        return self.image_s

    def decode_step_s(self, sequences: int) -> float:
        """The decode part of a step in which `sequences` sequences emit a token."""
        if sequences == 0:
            return 0.0
        return self.decode_step_base_s + self.decode_step_per_seq_s * sequences


def engine_time_profile(params: EngineParams, name: str = "engine-time") -> ModelProfile:
    """The profile that prices work in this engine's own time: its prefill rate, image
    time and batched decode curve, at a full replica's batch (what `fairq calibrate`
    fits on the simulated engine)."""
    return ModelProfile(
        name=name,
        alpha=params.alpha,
        decode_base_s=params.decode_step_base_s,
        decode_per_seq_s=params.decode_step_per_seq_s,
        operating_batch=params.max_sequences,
        gamma=params.image_s,
    )


def load_engine_params(path: str | Path) -> EngineParams:
    """Read engine parameters from TOML (top-level keys, as in configs/engine.toml)."""
    return read_toml(path, EngineParams)


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one engine iteration did and how long it took."""

    duration_s: float
    # Sequences that emitted their first output token (their prefill completed).
    first_tokens: list[SeqId] = field(default_factory=list)
    # Sequences that emitted one decode token (prefill completed in an earlier step).
    tokens: list[SeqId] = field(default_factory=list)
    # Sequences that emitted their last token in this step and left the engine.
    finished: list[SeqId] = field(default_factory=list)
    # The engine time attributed to each finished sequence over its whole run.
    engine_s: dict[SeqId, float] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class _Sequence:
    id: SeqId
    input_tokens: int
    output_tokens: int
    images: int
    priority: int
    prefilled: int = 0
    # Engine seconds of its prefill chunks and images so far.
    prefill_s: float = 0.0
    # The engine's running sum of decode shares before its first token (None until
    # then): its decode time is what the sum grew by since.
    shares_before: float | None = None

    @property
    def kv_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


class BatchingEngineModel:
    """Continuous batching: a waiting queue, a running set, and `step()`.

    Waiting sequences are admitted by priority (higher first), then arrival, when a
    sequence slot and their whole KV reservation (input + output tokens) are free; the
    head of the queue is never overtaken, so a large request cannot starve. No preemption.

    Per step the work is proportional to the sequences that emit a token or get a prefill
    chunk, plus O(log n) per admission; finishes are scheduled by step number, so
    running sequences are never scanned.
    """

    def __init__(self, params: EngineParams | None = None) -> None:
        self.params = params or EngineParams()
        self._arrivals = itertools.count()
        # Heap of (-priority, arrival, sequence); aborted entries are skipped lazily.
        self._queue: list[tuple[int, int, _Sequence]] = []
        self._waiting: dict[SeqId, _Sequence] = {}
        # Running sequences, in admission order (dicts keep insertion order).
        self._prefilling: dict[SeqId, _Sequence] = {}
        self._decoding: dict[SeqId, _Sequence] = {}
        # Step number -> sequences that emit their last token in that step.
        self._finish_at: dict[int, list[_Sequence]] = {}
        self._step = 0
        self._kv_used = 0
        # The sum over steps of one emitting sequence's share of the decode part: every
        # decoding sequence emits a token in every step, so each one's decode time is a
        # difference of two readings, and a step costs O(1) to attribute.
        self._decode_shares = 0.0

    # -- state ------------------------------------------------------------------------

    @property
    def running(self) -> int:
        """Sequences admitted and not yet finished (prefilling or decoding)."""
        return len(self._prefilling) + len(self._decoding)

    @property
    def waiting(self) -> int:
        """Sequences added and not yet admitted."""
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        return not (self._waiting or self._prefilling or self._decoding)

    @property
    def free_sequences(self) -> int:
        return self.params.max_sequences - self.running

    @property
    def free_kv_tokens(self) -> int:
        return self.params.kv_cache_tokens - self._kv_used

    @property
    def steps(self) -> int:
        """Steps run so far."""
        return self._step

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._waiting or seq_id in self._prefilling or seq_id in self._decoding

    # -- commands ---------------------------------------------------------------------

    def add(
        self,
        seq_id: SeqId,
        input_tokens: int,
        output_tokens: int,
        images: int = 0,
        priority: int = 0,
        cached_tokens: int = 0,
    ) -> None:
        """Queue a sequence; it generates exactly `output_tokens` tokens once admitted.
        Its first `cached_tokens` input tokens are in the prefix cache: not prefilled
        (the last input token always is, as in vLLM, to produce the first output)."""
        if seq_id in self:
            raise ValueError(f"sequence {seq_id!r} is already in the engine")
        if input_tokens < 1:
            raise ValueError(
                f"sequence {seq_id!r}: input_tokens must be >= 1, got {input_tokens!r}"
            )
        if output_tokens < 1:
            raise ValueError(
                f"sequence {seq_id!r}: output_tokens must be >= 1, got {output_tokens!r}"
            )
        if images < 0:
            raise ValueError(f"sequence {seq_id!r}: images must be >= 0, got {images!r}")
        if input_tokens + output_tokens > self.params.kv_cache_tokens:
            raise ValueError(
                f"sequence {seq_id!r}: input + output = {input_tokens + output_tokens} "
                f"tokens can never fit the KV cache of {self.params.kv_cache_tokens}"
            )
        if cached_tokens < 0:
            raise ValueError(
                f"sequence {seq_id!r}: cached_tokens must be >= 0, got {cached_tokens!r}"
            )
        seq = _Sequence(
            seq_id,
            input_tokens,
            output_tokens,
            images,
            priority,
            prefilled=min(cached_tokens, input_tokens - 1),
        )
        self._waiting[seq_id] = seq
        heapq.heappush(self._queue, (-priority, next(self._arrivals), seq))

    def abort(self, seq_id: SeqId) -> bool:
        """Remove a sequence wherever it is, freeing its slot and KV; False if unknown."""
        if self._waiting.pop(seq_id, None) is not None:
            return True  # its heap entry is dropped when it reaches the head
        seq = self._prefilling.pop(seq_id, None) or self._decoding.pop(seq_id, None)
        if seq is None:
            return False
        self._kv_used -= seq.kv_tokens  # a stale _finish_at entry is skipped later
        return True

    def step(self) -> StepResult:
        """Run one engine iteration; an idle engine returns a zero-length step."""
        self._admit()
        step = self._step
        self._step += 1
        # Captured before this step's prefills complete: those emit first tokens instead.
        tokens = list(self._decoding)
        prefill_tokens, images, first_tokens, done = self._prefill(step)
        emitting = len(tokens) + len(first_tokens)
        decode_s = self.params.decode_step_s(emitting)
        if emitting:
            self._decode_shares += decode_s / emitting
        for seq in self._finish_at.pop(step, ()):
            if self._decoding.get(seq.id) is seq:  # not aborted (or re-added) meanwhile
                del self._decoding[seq.id]
                self._kv_used -= seq.kv_tokens
                done.append(seq)
        params = self.params
        duration = prefill_tokens / params.prefill_tokens_per_s + images * params.image_s + decode_s
        engine_s = {seq.id: self._attributed(seq) for seq in done}
        return StepResult(duration, first_tokens, tokens, [seq.id for seq in done], engine_s)

    def engine_s(self, seq_id: SeqId) -> float:
        """Engine time attributed so far to a sequence in the engine (0 if unknown)."""
        seq = self._prefilling.get(seq_id) or self._decoding.get(seq_id)
        return 0.0 if seq is None else self._attributed(seq)

    def _attributed(self, seq: _Sequence) -> float:
        if seq.shares_before is None:
            return seq.prefill_s
        return seq.prefill_s + self._decode_shares - seq.shares_before

    # -- internals --------------------------------------------------------------------

    def _admit(self) -> None:
        params = self.params
        queue = self._queue
        while queue:
            seq = queue[0][2]
            if self._waiting.get(seq.id) is not seq:
                heapq.heappop(queue)  # aborted while waiting
                continue
            if (
                self.running >= params.max_sequences
                or self._kv_used + seq.kv_tokens > params.kv_cache_tokens
            ):
                return
            heapq.heappop(queue)
            del self._waiting[seq.id]
            self._prefilling[seq.id] = seq
            self._kv_used += seq.kv_tokens

    def _prefill(self, step: int) -> tuple[int, int, list[SeqId], list[_Sequence]]:
        """Prefill chunks within the budget; returns tokens, images, first tokens, and
        the sequences whose only output token that was."""
        params = self.params
        budget = params.max_batched_tokens
        used = images = 0
        completed: list[_Sequence] = []
        prefilling = self._prefilling.values()
        if len(self._prefilling) > 1:
            # Priority scheduling (vLLM's "priority" policy): chunks go to the highest
            # priority first, then admission order (sorted() is stable).
            prefilling = sorted(prefilling, key=lambda seq: -seq.priority)
        for seq in prefilling:
            if used == budget:
                break
            images += seq.images  # encoded in the step its prefill starts
            chunk = min(seq.input_tokens - seq.prefilled, budget - used)
            seq.prefill_s += chunk / params.prefill_tokens_per_s + seq.images * params.image_s
            seq.images = 0
            seq.prefilled += chunk
            used += chunk
            if seq.prefilled == seq.input_tokens:
                completed.append(seq)
        first_tokens: list[SeqId] = []
        finished: list[_Sequence] = []
        for seq in completed:
            del self._prefilling[seq.id]
            first_tokens.append(seq.id)
            # This step's share is added after the prefill: the first token's share
            # counts from the reading before it.
            seq.shares_before = self._decode_shares
            if seq.output_tokens == 1:
                self._kv_used -= seq.kv_tokens
                finished.append(seq)
            else:
                self._decoding[seq.id] = seq
                # Token k (1-based) comes in step `step + k - 1`.
                self._finish_at.setdefault(step + seq.output_tokens - 1, []).append(seq)
        return used, images, first_tokens, finished
