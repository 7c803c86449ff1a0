"""The dispatcher's own settings and message handling, without a broker (the worker pool:
test_core_workers)."""

from __future__ import annotations

import pytest
from nats.aio.msg import Msg

from broker_config.config import BrokerSettings, DispatcherOptions
from dispatcher.park import HDR_PARKED_AT, HDR_PARKED_ID, restore, stored_at

SUBJECTS = BrokerSettings().subjects


def test_options_refuse_a_window_larger_than_what_may_be_held():
    with pytest.raises(ValueError, match="tenant_window"):
        DispatcherOptions(tenant_window=2000, max_ack_pending=1000)
    with pytest.raises(ValueError, match="tenant_window"):
        DispatcherOptions(tenant_window=1)


ACK = "$JS.ACK.FQ_{stream}.fq~{consumer}.1.17.5.1795997433664286007.2"  # stored at ...433.66


def delivered(subject: str, headers: dict[str, str], stream: str, consumer: str) -> Msg:
    return Msg(None, subject=subject, reply=ACK.format(stream=stream, consumer=consumer),
               headers=headers)


def test_only_a_parked_copy_keeps_the_original_store_time_and_id():
    forged = {"Nats-Msg-Id": "r1", HDR_PARKED_AT: "1", HDR_PARKED_ID: "other"}
    # A client sent the parking headers with its request: neither is believed.
    direct = delivered("fq.q.3.chat.acme", forged, "REQUESTS", "shard~3")
    assert stored_at(direct, SUBJECTS) == pytest.approx(1795997433.664286)
    # A parked copy: stored at its move, first stored at Fq-Parked-At, its id restored.
    parked = delivered("fq.park.chat.acme", {"Nats-Msg-Id": "park-17", HDR_PARKED_ID: "r1",
                                             HDR_PARKED_AT: "1700000000000000000"},
                       "PARKED", "parked~acme")
    assert stored_at(parked, SUBJECTS) == 1700000000.0
    assert restore(parked).headers == {"Nats-Msg-Id": "r1",
                                       HDR_PARKED_AT: "1700000000000000000"}
