"""A small model tokenizer built on the spot (tests, the demo and benchmarks never download one).

``build_tokenizer_dir`` trains a byte-level BPE on a little text with the ``tokenizers`` trainers
and writes what a model directory holds: ``tokenizer.json`` and ``tokenizer_config.json`` with a
ChatML chat template and its special tokens. The router loads it through the same code as a real
model's directory.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = "<|endoftext|>"
SPECIALS = [BOS, "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there been one all we their has would when if so no what can out other more will up its "
    "cache block token replica router prompt session prefix model engine request event index hash batch"
).split()


def sample_text(words: int, seed: int = 0) -> str:
    """Plain text from a fixed vocabulary (for corpora and prompts)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def build_tokenizer_dir(directory: str | Path, corpus: Iterable[str] | None = None, vocab_size: int = 1000) -> Path:
    """Train a byte-level BPE and write a model's tokenizer files into ``directory``."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(list(corpus) if corpus is not None else [sample_text(4000, s) for s in range(4)], trainer)
    bos_id = tok.token_to_id(BOS)
    # /v1/completions encodes with special tokens: a BOS first, as many models do.
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos_id)])
    tok.save(str(path / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "bos_token": BOS, "eos_token": "<|im_end|>", "model_max_length": 1 << 20}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return path
