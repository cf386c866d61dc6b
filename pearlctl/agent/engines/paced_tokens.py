"""The paced engine's tokens: what text a prompt's ids stand for, which ids it generates, and their text.

Deterministic (pearlctl/agent/engines/paced.py, "Tokens are deterministic"): a sequence's next token is a function
of a rolling hash of every token before it, started from the name of the weights loaded, so a continuation
generates exactly what the uninterrupted request would have. With the model directory's ``tokenizer.json`` the
text is the real tokenizer's (`Vocab`, `Decoder`); without one a text's ids are its UTF-8 bytes and generated ids
printable ASCII.
"""

from __future__ import annotations

import array
import hashlib
from pathlib import Path
from typing import Any

FIRST_PRINTABLE, PRINTABLE = 32, 95  # generated ids: printable ASCII, one character each
MIN_STANDALONE = 64  # fewer standalone ids than this (Vocab): every id is generated, and stepped through the stream


# A sequence's rolling state is a 64-bit BLAKE2b digest of its tokens so far (each a 4-byte unsigned integer),
# started from the weights' name: hashlib updates incrementally and in C, so a prompt of thousands of token ids
# costs microseconds where a hash stepped in Python cost milliseconds a request, and a digest does not end the
# hash, so the state after every generated token is one update and one digest.
def started(seed: bytes) -> Any:
    """A rolling hash at the start of a sequence, for weights named ``seed``."""
    return hashlib.blake2b(seed, digest_size=8)


def state_of(rolling: Any) -> int:
    """The rolling state of the tokens fed to ``rolling`` so far: what picks the next token."""
    return int.from_bytes(rolling.digest(), "little")


def token_bytes(tokens: list[int]) -> bytes:
    return array.array("I", tokens).tobytes()


def logprob(state: int) -> float:
    """A made-up log-probability of the token `next_token(state)` picked: deterministic, in (-3, 0]."""
    return -((state >> 40) % 3000) / 1000.0


def weights_seed(path: str) -> bytes:
    """The rolling state's start for the weights loaded from `path`, named by its last component (the engine reads
    no file): a version's directory has the version's name on the node-local store and on shared disk alike
    (pearlctl/trainer/weights.py), so both give the same tokens."""
    return (Path(path).name or path).encode()


class Vocab:
    """Text to ids and ids to text. With the model directory's ``tokenizer.json`` (read with the ``tokenizers``
    library, as the gateway reads it: pearlctl/router/text.py): text is encoded by it, generated ids are drawn from
    its vocabulary, and a request's text is decoded as vLLM decodes it, one ``DecodeStream`` primed with the
    prompt's ids, so the gateway's text for a continued turn equals this engine's for an uninterrupted one.
    Without one: a text's ids are its UTF-8 bytes and generated ids printable ASCII, one character each.

    Generated ids are drawn from the vocabulary's *standalone* ids (`standalone`): whole printable characters whose
    text is the same after another such id as alone. Stepping a ``DecodeStream`` costs microseconds a token, most
    of a paced engine's CPU when 64 of them decode millions of tokens; after a standalone id the stream is at a
    character boundary, so each next one adds exactly its own text, looked up (`Decoder`). The first generated id
    is still stepped through the stream primed with the prompt, whose last ids may end inside a character."""

    def __init__(self, model: str):
        self.tokenizer = None
        self.table: dict[int, str] = {}  # standalone id -> its text
        self.ids: list[int] = []  # the ids generated: the standalone ones (all of them when too few are)
        path = Path(model) / "tokenizer.json"
        if path.is_file():
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(path))
            table = standalone(self.tokenizer)
            if len(table) >= MIN_STANDALONE:
                self.table, self.ids = table, sorted(table)
            else:
                self.ids = list(range(self.tokenizer.get_vocab_size()))

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return self.tokenizer.encode(text).ids

    def pick(self, state: int) -> int:
        """The id generated after rolling state `state`."""
        if self.tokenizer is None:
            return FIRST_PRINTABLE + (state >> 17) % PRINTABLE
        return self.ids[(state >> 17) % len(self.ids)]

    def piece(self, token: int) -> str:
        """One id's own text (a logprob entry's ``token``)."""
        if self.tokenizer is None:
            return chr(token)
        text = self.table.get(token)
        return text if text is not None else self.tokenizer.decode([token], skip_special_tokens=False)

    def decoder(self, prompt: list[int]) -> Decoder:
        return Decoder(self, prompt)


def standalone(tokenizer: Any) -> dict[int, str]:
    """The ids whose text stands alone, with their text: not special, whole printable characters, and decoded after
    another such id as that id's text followed by theirs (a byte-level BPE's whole-character tokens; not a
    sentencepiece word start, whose space depends on what precedes it)."""
    n = tokenizer.get_vocab_size()
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    alone = tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=True)
    kept = [i for i, t in enumerate(alone) if i not in special and t and t.isprintable() and "\ufffd" not in t]
    if not kept:
        return {}
    first = kept[0]
    after = tokenizer.decode_batch([[first, i] for i in kept], skip_special_tokens=True)
    return {i: alone[i] for i, t in zip(kept, after, strict=True) if t == alone[first] + alone[i]}


class Decoder:
    """One request's text, stepped through its generated ids in order: the first through a ``DecodeStream`` primed
    with the prompt, as vLLM decodes; the next ones, standalone (`Vocab`), by their own text."""

    def __init__(self, vocab: Vocab, prompt: list[int]):
        self.vocab = vocab
        self.stepped = False  # the stream has decoded a generated id: standalone ones after it are looked up
        self.stream = None
        if vocab.tokenizer is not None:
            from tokenizers.decoders import DecodeStream

            # primed with the whole prompt, as vLLM's incremental detokenizer is (``DecodeStream(ids=...)`` prefills
            # without decoding it): a prompt that ends in part of a character, even before many special ids, gives
            # the first generated id's text that part too
            self.stream = DecodeStream(ids=list(prompt), skip_special_tokens=True)

    def pieces(self, ids: list[int]) -> list[str]:
        """The text each of these next ids adds (empty for an id that completes no character yet)."""
        if self.stream is None:
            return [chr(t) for t in ids]
        out = []
        table = self.vocab.table
        for t in ids:
            if self.stepped and t in table:
                out.append(table[t])
                continue
            self.stepped = True
            try:
                out.append(self.stream.step(self.vocab.tokenizer, t) or "")
            except Exception:  # a prefix the stream cannot decode: vLLM starts a fresh stream, as here
                from tokenizers.decoders import DecodeStream

                self.stream = DecodeStream(skip_special_tokens=True)
                out.append(self.stream.step(self.vocab.tokenizer, t) or "")
        return out


def chat_prompt(messages: list[dict]) -> str:
    """The engine's chat template: each message as ``<|role|>`` and its text, then ``<|assistant|>``."""
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: their text
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"<|{m.get('role', 'user')}|>\n{content or ''}\n")
    return "".join(parts) + "<|assistant|>\n"
