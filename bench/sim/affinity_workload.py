"""A multi-turn chat workload whose prompts share long prefixes, for routing benchmarks.

Sessions start at random over the run; each uses one of a few long system prompts
(agents and assistants of one product share theirs) and sends `turns` turns, each
`think_s` (exponential) after the previous one was sent. A turn's prompt is the system
prompt, the whole conversation so far (earlier messages and answers) and a new user
message: later turns grow, and all but the new message is a prefix some replica
already computed, if the turn lands where the conversation's earlier turns ran.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from dispatcher.sim.trace import TraceRecord


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    sessions: int = 3000
    turns: int = 5
    duration_s: float = 600.0  # sessions start uniformly in [0, duration_s)
    system_prompts: int = 8
    system_tokens: int = 2000
    message_tokens: tuple[int, int] = (50, 300)  # a user message, uniform
    answer_tokens: tuple[int, int] = (50, 300)  # an answer, uniform
    think_s: float = 20.0  # mean time between a session's turns
    tenants: int = 4

    def __post_init__(self) -> None:
        if min(self.sessions, self.turns, self.system_prompts, self.tenants) < 1:
            raise ValueError("sessions, turns, system_prompts and tenants must be >= 1")
        if self.duration_s <= 0 or self.think_s < 0 or self.system_tokens < 0:
            raise ValueError("duration_s must be > 0, think_s and system_tokens >= 0")
        for low, high in (self.message_tokens, self.answer_tokens):
            if not 1 <= low <= high:
                raise ValueError("token ranges must satisfy 1 <= low <= high")


def chat_turns(workload: ChatWorkload, seed: int) -> list[TraceRecord]:
    """Every turn of every session, in arrival order."""
    rng = random.Random(seed)
    turns = []
    for n in range(workload.sessions):
        session = f"chat-{n:05d}"
        tenant = f"team{n % workload.tenants + 1}"
        system = rng.randrange(workload.system_prompts)
        at = rng.uniform(0, workload.duration_s)
        history = 0
        for _ in range(workload.turns):
            message = rng.randint(*workload.message_tokens)
            answer = rng.randint(*workload.answer_tokens)
            turns.append(
                TraceRecord(
                    tenant=tenant,
                    arrival_s=at,
                    input_tokens=workload.system_tokens + history + message,
                    output_tokens=answer,
                    max_tokens=answer,
                    session=session,
                    prefix_id=f"system-{system}",
                    prefix_tokens=workload.system_tokens,
                    history_tokens=history,
                )
            )
            history += message + answer
            at += rng.expovariate(1 / workload.think_s) if workload.think_s else 0.0
    turns.sort(key=lambda t: t.arrival_s)
    return turns
