"""Build a tiny Llama model directory for vLLM's CPU build, locally and deterministically.

Run with the vLLM venv's Python (it needs ``torch``, ``transformers`` and ``tokenizers``, which
the router's own environment does not carry): ``python build_model.py OUT_DIR [--size tiny|small]``.
Nothing is downloaded. The weights are random (seeded), the tokenizer is a byte-level BPE
trained on generated text made of the lab workload's vocabulary, and ``tokenizer_config.json``
carries a Llama-3-style Jinja chat template, so vLLM and the router render and tokenize prompts
from the same files. The same size and seed give the same files.

This file imports nothing from the project: it runs in another interpreter.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

# The lab workload's words (extproc_lab.demo.workload._VOCAB) and some more, so that the BPE
# learns whole words for the prompts the benchmarks send.
WORDS = (
    "the of and to in is that for it as with was on be by this are from or at an which have not "
    "cache replica token prefix session model request latency block memory route gateway envoy "
    "queue batch decode prefill attention layer weight tensor kernel shard stream cluster pool "
    "river mountain garden window letter market harbor engine signal winter summer autumn spring "
    "you are a helpful assistant please read document answer questions about question hello world "
    "what how why when where who can could would should will one two three four five six seven"
).split()

SIZES = {
    # name: (layers, hidden, heads, kv heads, intermediate, vocab)
    "tiny": (2, 128, 4, 2, 256, 2048),
    "small": (4, 256, 4, 2, 512, 2048),
}

BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"
SPECIALS = [BOS, "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", EOS]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def corpus(seed: int, lines: int = 4000) -> list[str]:
    """Generated text: lines of the workload's words, some capitalised, with punctuation and digits."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        ws = [rng.choice(WORDS) for _ in range(rng.randint(5, 30))]
        if rng.random() < 0.3:
            ws[0] = ws[0].capitalize()
        out.append(" ".join(ws) + rng.choice([".", ",", "?", ":", ""]) + f" {i % 100}")
    return out


def build_tokenizer(out: Path, vocab: int, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast  # type: ignore[import-not-found,unused-ignore]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token="<|end_of_text|>", model_max_length=8192
    )
    fast.save_pretrained(str(out))
    # The chat template inside tokenizer_config.json, where vLLM and the router both look first
    # (recent transformers would write a chat_template.jinja beside it instead).
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(chat_template=CHAT_TEMPLATE, tokenizer_class="PreTrainedTokenizerFast")
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def build_model(out: Path, size: str, seed: int) -> None:
    import torch  # type: ignore[import-not-found,unused-ignore]
    from tokenizers import Tokenizer
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # type: ignore[import-not-found,unused-ignore]

    layers, hidden, heads, kv_heads, inter, _ = SIZES[size]
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=8192,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id("<|end_of_text|>"),
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id).save_pretrained(str(out))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    tmp = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build_tokenizer(tmp, SIZES[args.size][5], args.seed)
    build_model(tmp, args.size, args.seed)
    (tmp / ".built").write_text(json.dumps({"size": args.size, "seed": args.seed}) + "\n")
    shutil.rmtree(args.out, ignore_errors=True)
    tmp.rename(args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
