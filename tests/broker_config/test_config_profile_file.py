"""`profile_file`: an endpoint's cost profile read from the file `fairq calibrate --out`
wrote, by the dispatcher and the workers alike, with no copying by hand."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from bench.harness.stack import benchmark_config
from broker_config.config import EXAMPLE_CONFIG, ConfigError, load_config
from broker_config.registry import Registry
from costmodel.units import ModelProfile, dump_profile
from workers.__main__ import _from_fairq_config

CALIBRATED = ModelProfile(name="my-gpu", alpha=0.0002, beta=0.03, gamma=0.0, capacity_mu_per_s=42.0)


def config_with(tmp_path: Path, chat_lines: str) -> Path:
    """The example config with `chat_lines` added to [endpoints.chat]."""
    text = EXAMPLE_CONFIG.read_text().replace(
        "[endpoints.chat]\n", f"[endpoints.chat]\n{chat_lines}\n", 1
    )
    path = tmp_path / "fairq.toml"
    path.write_text(text)
    return path


def config_naming(tmp_path: Path, profile_file: str) -> Path:
    """The example config with chat's `profile` replaced by `profile_file`."""
    path = config_with(tmp_path, "")
    path.write_text(
        path.read_text().replace('profile = "llama-7b-sim"', f'profile_file = "{profile_file}"', 1)
    )
    return path


def test_the_dispatcher_and_the_workers_read_the_calibrated_profile_file(tmp_path) -> None:
    (tmp_path / "profiles").mkdir()
    dump_profile(CALIBRATED, tmp_path / "profiles" / "my-gpu.toml")
    path = config_naming(tmp_path, "profiles/my-gpu.toml")
    config = load_config(path)  # relative to the config file, not the working directory
    assert config.endpoints["chat"].profile == "my-gpu"
    assert Registry(config).profile("chat") == CALIBRATED
    _, worker_profile, _, _ = _from_fairq_config(path, "chat")
    assert worker_profile == CALIBRATED
    # The loaded config stands on its own (bench/harness/stack.py writes it out elsewhere): the
    # profile is one of its profiles, and no file is named any more.
    assert config.endpoints["chat"].profile_file is None
    assert b"profile_file" not in msgspec.toml.encode(config.endpoints)


def test_a_profile_file_and_a_profile_name_together_are_refused(tmp_path) -> None:
    dump_profile(CALIBRATED, tmp_path / "my-gpu.toml")
    with pytest.raises(ConfigError, match="endpoints.chat.profile_file.*not both"):
        load_config(config_with(tmp_path, 'profile_file = "my-gpu.toml"'))


def test_a_missing_or_bad_profile_file_is_a_config_error_naming_it(tmp_path) -> None:
    path = config_naming(tmp_path, "absent.toml")
    with pytest.raises(ConfigError, match="endpoints.chat.profile_file.*absent.toml"):
        load_config(path)
    (tmp_path / "absent.toml").write_text("alpha = -1\n")
    with pytest.raises(ConfigError, match="alpha must be finite and >= 0"):
        load_config(path)


def test_a_profile_file_may_not_redefine_a_named_profile_differently(tmp_path) -> None:
    dump_profile(ModelProfile(name="llama-7b-sim", alpha=9.0), tmp_path / "clash.toml")
    path = config_naming(tmp_path, "clash.toml")
    with pytest.raises(ConfigError, match="differs from the one of that name"):
        load_config(path)


def test_a_loaded_config_written_back_out_reads_the_same(tmp_path) -> None:
    """bench/harness/stack.py and bench/chaos/run.py write a loaded config out for their processes:
    every optional field left unset (a tier's or tenant's quota, a tenant's weight) must
    survive TOML, which has no null, and a tokenizer stays where it was."""
    (tmp_path / "tok.json").write_text("{}")
    path = config_with(tmp_path, 'tokenizer = "tok.json"')
    config = load_config(path)
    assert config.endpoints["chat"].tokenizer == str(tmp_path / "tok.json")
    written = tmp_path / "written.toml"
    written.write_bytes(msgspec.toml.encode(config))
    assert load_config(written) == config
    assert load_config(EXAMPLE_CONFIG) == msgspec.toml.decode(
        msgspec.toml.encode(load_config(EXAMPLE_CONFIG)), type=type(config)
    )
    weighted = benchmark_config({"acme": 2.0, "globex": 1.0})
    assert msgspec.toml.decode(msgspec.toml.encode(weighted), type=type(config)) == weighted
