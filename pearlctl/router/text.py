"""The text of a continued turn, detokenized by the gateway exactly as the uninterrupted run would have it.

Why: vLLM detokenizes a request's output with the ``tokenizers`` library's ``DecodeStream``, primed with the
request's prompt ids. A continuation's prompt is the turn's prompt plus the tokens generated so far, and
when those end inside a character (a multi-byte UTF-8 character split over byte-level tokens: CJK text,
emoji, math symbols, or a model's stray byte token) the primed stream is off: its first text repeats the
whole prompt's text and everything generated before it. A caller would read its own chat template in the
middle of the answer. So for the parts after an interruption the gateway does not take vLLM's text: it
steps one ``DecodeStream`` primed with the turn's original prompt through every token id of every part, the
same steps vLLM takes for an uninterrupted request (``vllm/v1/engine/detokenizer.py``,
``FastIncrementalDetokenizer``), and a character split across two parts comes out whole, once.

Guarantees:
- given the model's ``tokenizer.json``, a continued turn's text equals the uninterrupted run's, whatever the
  boundary (tests/unit/test_gateway.py checks every boundary of real outputs of the tiny model);
- without one (a model directory that has none, a hub id the head node cannot read), or for a request this
  cannot mirror (stop strings, which vLLM matches on its own text, or ``spaces_between_special_tokens`` off),
  the parts keep vLLM's text, as before; the gateway says so once per model in its log;
- a tokenizer is read from the directory a worker's ``/v1/models`` names (``root``), or for a hub id from the
  local Hugging Face cache; never downloaded;
- a tokenizer is read once per model directory, in a thread, and kept; a failure to read it is not retried
  for the same directory.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path

from huggingface_hub import try_to_load_from_cache
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

log = logging.getLogger("pearlctl.router")

INVALID_PREFIX = "Invalid prefix encountered"  # tokenizers' error when a stream's state breaks (vLLM resets it)


def mirrorable(body: dict) -> str | None:
    """Why a request's continued text cannot be mirrored here (None: it can)."""
    if body.get("stop"):
        return "stop strings are matched by vLLM on its own text"
    if body.get("spaces_between_special_tokens") is False:
        return "spaces_between_special_tokens is off"
    return None


class TextMirror:
    """One turn's detokenization: primed with its prompt ids, stepped through every generated id in order."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], generated: list[int], skip_special: bool):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=skip_special)
        self.text(generated)  # what the caller already has (its text came from the first part)

    def _step(self, token_id: int) -> str:
        try:
            piece = self.stream.step(self.tokenizer, token_id)
        except (OverflowError, TypeError):
            return ""  # an id the tokenizer does not know: vLLM logs it and emits nothing
        except Exception as exc:
            if not str(exc).startswith(INVALID_PREFIX):
                raise
            self.stream = DecodeStream(skip_special_tokens=self.skip_special)  # vLLM's recovery, the same
            piece = self.stream.step(self.tokenizer, token_id)
        return piece or ""

    def text(self, ids: list[int]) -> str:
        """The text these next ids add."""
        return "".join(self._step(t) for t in ids)


class Tokenizers:
    """The serving models' tokenizers, by model directory: read once (``tokenizer.json``), then kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_root: dict[str, Tokenizer | None] = {}

    def get(self, root: str) -> Tokenizer | None:
        """Blocking (file I/O, parsing): call it in a thread."""
        with self._lock:
            if root in self._by_root:
                return self._by_root[root]
        path = Path(root) / "tokenizer.json"
        if not path.is_file():  # a hub id: its tokenizer from the local cache only (no download from here)
            with contextlib.suppress(Exception):
                cached = try_to_load_from_cache(root, "tokenizer.json")
                path = Path(cached) if isinstance(cached, str) else path
        try:
            tokenizer: Tokenizer | None = Tokenizer.from_file(str(path))
        except Exception as exc:  # missing, unreadable, or a format this tokenizers version cannot read
            log.warning("continued turns of %s keep vLLM's text: cannot read %s (%s)", root, path, exc)
            tokenizer = None
        with self._lock:
            self._by_root.setdefault(root, tokenizer)
            return self._by_root[root]
