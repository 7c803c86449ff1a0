"""Build a tiny random-weight Llama model with a real tokenizer, fully offline.

It exists so that the real vLLM engine can be started and tested on a CPU without any
model hub: a byte-level BPE tokenizer trained on the Python standard library's own
sources, a chat template, and a two-layer Llama with random bf16 weights (a few MB).
Its output is gibberish; its token counts, streaming, scheduling and aborts are real.

    python -m workers.tiny_model OUT_DIR [--seed N]

transformers, tokenizers and torch are imported inside the functions: the main fairq
environment does not have them, only the vLLM environment does.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]

# ChatML-style; the generation prompt opens the assistant's turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

VOCAB_SIZE = 3072
# Long enough that a test's request can outlast the test's own steps on a slow machine.
MAX_POSITIONS = 8192
# Enough Python source for ~3k merges while training in a second or two.
CORPUS_CHARS = 1_500_000


def _stdlib_texts(limit_chars: int) -> Iterator[str]:
    """The standard library's top-level modules, in a fixed order, up to `limit_chars`."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    remaining = limit_chars
    for path in sorted(stdlib.glob("*.py")):
        if remaining <= 0:
            return
        text = path.read_text(encoding="utf-8", errors="replace")[:remaining]
        remaining -= len(text)
        yield text


def build_tokenizer(
    vocab_size: int = VOCAB_SIZE, corpus_chars: int = CORPUS_CHARS
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on local text and wrap it for transformers."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = list(_stdlib_texts(corpus_chars))
    if not texts:
        raise RuntimeError("no standard library sources found to train the tokenizer on")
    backend.train_from_iterator(texts, trainer=trainer)
    # Plain prompts start with BOS like a Llama prompt; the chat template adds its own.
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, backend.token_to_id(BOS))]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=MAX_POSITIONS,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write a tokenizer and a random-weight Llama (bf16, safetensors) to `out_dir`.

    The same seed gives the same weights; the tokenizer depends only on the local
    standard library. Returns the directory, which vLLM or transformers load as a model.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workers.tiny_model", description=__doc__.splitlines()[0]
    )
    parser.add_argument("out_dir", type=Path, help="directory to write the model into")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    print(build_tiny_model(args.out_dir, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
