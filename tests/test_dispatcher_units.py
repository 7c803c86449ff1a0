"""The dispatcher's own settings, without a broker (the worker pool: test_core_workers)."""

from __future__ import annotations

import pytest

from broker_config.config import DispatcherOptions


def test_options_refuse_a_window_larger_than_what_may_be_held():
    with pytest.raises(ValueError, match="tenant_window"):
        DispatcherOptions(tenant_window=2000, max_ack_pending=1000)
    with pytest.raises(ValueError, match="tenant_window"):
        DispatcherOptions(tenant_window=1)
