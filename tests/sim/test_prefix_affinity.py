"""The simulator's prefix cache and affinity: the cache model, a trace record's blocks,
prefill skipped for cached tokens, and routing that keeps a conversation's turns where
its context is cached."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.sim.affinity_workload import ChatWorkload, chat_turns
from broker_config.config import EXAMPLE_CONFIG, load_config
from costmodel.engine_model import BatchingEngineModel, EngineParams
from costmodel.prefix_cache import BLOCK_TOKENS, PrefixCache
from dispatcher.core.limits import scheduling_only
from dispatcher.sim.simulator import simulate
from dispatcher.sim.trace import TraceRecord, TraceRecordError


def test_only_the_leading_cached_blocks_count_and_the_least_recent_go_first() -> None:
    cache = PrefixCache(capacity_blocks=4)
    cache.insert(["a", "b", "c"])
    assert cache.match(["a", "b", "x", "c"]) == 2  # the first miss ends the match
    cache.insert(["d", "e"])  # five blocks: "c", the least recently used, goes
    assert len(cache) == 4 and cache.match(["c"]) == 0 and cache.match(["a", "b", "d"]) == 3
    with pytest.raises(ValueError, match="capacity_blocks"):
        PrefixCache(0)


def test_a_turn_finds_what_its_sessions_earlier_turn_and_its_system_prompt_left() -> None:
    first = TraceRecord(
        "t", 0.0, input_tokens=100, output_tokens=60, session="s", prefix_id="sys", prefix_tokens=64
    )
    second = TraceRecord(
        "t",
        5.0,
        input_tokens=200,
        output_tokens=10,
        session="s",
        prefix_id="sys",
        prefix_tokens=64,
        history_tokens=96,
    )
    cache = PrefixCache(1000)
    cacheable, computed = first.context_blocks(BLOCK_TOKENS)
    assert cache.match(cacheable) == 0 and len(cacheable) == 4  # the system prompt only
    cache.insert(computed)  # 64 system tokens, then 36 + 60 of the conversation: 6 blocks
    cacheable, _ = second.context_blocks(BLOCK_TOKENS)
    assert cache.match(cacheable) == 4 + 6
    other = TraceRecord(
        "t", 5.0, 200, 10, session="other", prefix_id="sys", prefix_tokens=64, history_tokens=96
    )
    assert cache.match(other.context_blocks(BLOCK_TOKENS)[0]) == 4


def test_a_records_cached_parts_cannot_exceed_its_prompt() -> None:
    with pytest.raises(TraceRecordError, match="history_tokens"):
        TraceRecord("t", 0.0, 100, 10, session="s", prefix_tokens=60, history_tokens=50)
    with pytest.raises(TraceRecordError, match="prefix_tokens"):
        TraceRecord("t", 0.0, 100, 10, prefix_tokens=-1)


def test_cached_tokens_are_not_prefilled_but_the_last_input_token_always_is() -> None:
    params = EngineParams(
        prefill_tokens_per_s=1000.0, decode_step_base_s=0.0, decode_step_per_seq_s=0.01
    )
    cold, warm, full = (BatchingEngineModel(params) for _ in range(3))
    cold.add("r", 1000, 1)
    warm.add("r", 1000, 1, cached_tokens=800)
    full.add("r", 1000, 1, cached_tokens=5000)
    assert cold.step().duration_s == pytest.approx(1.0 + 0.01)
    assert warm.step().duration_s == pytest.approx(0.2 + 0.01)
    assert full.step().duration_s == pytest.approx(0.001 + 0.01)
    with pytest.raises(ValueError, match="cached_tokens"):
        cold.add("s", 10, 1, cached_tokens=-1)


def test_affinity_keeps_conversations_where_their_context_is_cached() -> None:
    """The benchmark's workload at its smoke size (4 replicas, busy but not overloaded).
    The load bound moves some turns (a home above 1.25x its share), so most, not all,
    of a conversation's turns run on one replica."""
    workload = ChatWorkload(
        sessions=200,
        turns=8,
        duration_s=200.0,
        system_tokens=500,
        message_tokens=(100, 400),
        answer_tokens=(100, 400),
    )
    trace = chat_turns(workload, seed=1)
    config = scheduling_only(load_config(EXAMPLE_CONFIG))
    on_home, cached = {}, {}
    for routed in (True, False):
        run = simulate(trace, config, replicas=4, affinity=routed, early_binding=True)
        homes: dict[str, Counter[str]] = {}
        for record, request in zip(trace, run.records, strict=True):
            homes.setdefault(record.session, Counter())[request.worker] += 1
        on_home[routed] = sum(c.most_common(1)[0][1] for c in homes.values()) / len(trace)
        cached[routed] = run.summary["simulation"]["cached_token_ratio"]
        assert {r.worker for r in run.records} == {f"chat-{i}" for i in range(4)}
    assert on_home[True] >= 0.85 and on_home[False] <= 0.6, on_home
    assert cached[True] >= 1.5 * cached[False], cached
