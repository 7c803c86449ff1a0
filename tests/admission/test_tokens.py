"""The dispatcher's own input count (dispatcher/admission/tokens.py): an endpoint's tokenizer,
whatever it was saved with, and a clear stop when it cannot be loaded."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from broker_config.config import Endpoint
from broker_config.wire import ChatMessage, SubmitRequest
from dispatcher.admission.tokens import INLINE_CHARS, InputCounter, TokenizerError
from dispatcher.dispatch.convert import prompt_text

ROOT = Path(__file__).resolve().parents[2]


def word_tokenizer(
    path: Path, *, truncate_at: int | None = None, pad_to: int | None = None
) -> Path:
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "[PAD]": 1, "word": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    if truncate_at is not None:
        tokenizer.enable_truncation(truncate_at)
    if pad_to is not None:
        tokenizer.enable_padding(pad_id=1, pad_token="[PAD]", length=pad_to)
    tokenizer.save(str(path))
    return path


async def test_counts_are_the_words_whatever_the_file_was_saved_with(tmp_path: Path) -> None:
    counter = InputCounter(
        {
            "plain": Endpoint(tokenizer=str(word_tokenizer(tmp_path / "plain.json"))),
            "truncating": Endpoint(
                tokenizer=str(word_tokenizer(tmp_path / "t.json", truncate_at=16))
            ),
            "padding": Endpoint(tokenizer=str(word_tokenizer(tmp_path / "p.json", pad_to=512))),
            "none": Endpoint(),
        }
    )
    short = SubmitRequest(prompt="word " * 10)
    long = SubmitRequest(messages=[ChatMessage("user", "word " * 1500)] * 2)
    assert len(prompt_text(long)) > INLINE_CHARS  # counted in a thread
    for endpoint in ("plain", "truncating", "padding"):
        assert await counter.count(endpoint, short) == 10
        assert await counter.count(endpoint, long) == 3000
    assert await counter.count("none", short) is None
    counts = await asyncio.gather(*(counter.count("plain", long) for _ in range(8)))
    assert counts == [3000] * 8


def test_a_file_that_is_not_a_tokenizer_names_the_field(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"endpoints\.chat\.tokenizer.*bad\.json"):
        InputCounter({"chat": Endpoint(tokenizer=str(tmp_path / "bad.json"))})
    with pytest.raises(TokenizerError, match=r"endpoints\.chat\.tokenizer.*absent\.json"):
        InputCounter({"chat": Endpoint(tokenizer=str(tmp_path / "absent.json"))})


@pytest.mark.integration
def test_the_dispatcher_stops_with_exit_2_on_a_tokenizer_it_cannot_load(
    tmp_path: Path, nats_url: str
) -> None:
    config = tmp_path / "fairq.toml"
    config.write_text(
        (ROOT / "configs" / "example.toml")
        .read_text()
        .replace("[endpoints.chat]\n", '[endpoints.chat]\ntokenizer = "absent.json"\n', 1)
    )
    run = subprocess.run(
        [sys.executable, "-m", "dispatcher", "--nats", nats_url, "--config", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stderr
    assert "endpoints.chat.tokenizer" in run.stderr and "absent.json" in run.stderr
    assert "Traceback" not in run.stderr
