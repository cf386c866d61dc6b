#!/usr/bin/env python3
"""Build the tiny local model the examples and engine tests use: no model hub needed.

A byte-level BPE tokenizer (vocab 2048, ChatML chat template, eos <|im_end|>) trained on generated
text, and a randomly initialised Llama (hidden 128, 2 layers, 4 heads, 2 KV heads, head_dim 32 — the
CPU attention backend needs head_dim >= 32), saved in HF format. Deterministic for a seed; a second
seed gives a "new policy" with the same shapes for weight-reload tests. ``--judge`` builds the tiny judge (a
generative reward model) instead: the same tokenizer, another shape (hidden 64, 1 layer, 2 heads), so that the
policy's weights loaded into it, or its into the policy, fail rather than serve.

    python scripts/build-tiny-model.py OUT_DIR [--seed 0] [--judge]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    words = (
        "the model calls a tool to add numbers and then answers with the sum of two values "
        "search lookup calculator result reward policy rollout step train sample token"
    ).split()
    out = []
    for _ in range(lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        text = " ".join(rng.choice(words) for _ in range(rng.randint(5, 20)))
        out.append(f"{text} {a} + {b} = {a + b}. <tool>calc({a},{b})</tool>")
    return out


# the model's shape: the policy's, and the judge's (it must differ: a mix-up of the two fails)
SHAPES = {
    "policy": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4},
    "judge": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2},
    # a judge slow enough on a CPU for its verdicts to back up behind a tiny rollout (tests/benchmarks/
    # bench_judge_live.py): about 26M parameters
    "judge-large": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 16},
}


def build(out: Path, seed: int, shape: str = "policy") -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus(0), trainer)  # the tokenizer never depends on the weight seed
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(fast),
        **SHAPES[shape],
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"tiny {shape} model: {n} parameters, seed {seed}, in {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--judge", action="store_true", help="the tiny judge's shape, not the policy's")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="any shape by name (--judge is --shape judge)")
    args = ap.parse_args()
    build(args.out, args.seed, args.shape or ("judge" if args.judge else "policy"))


if __name__ == "__main__":
    main()
