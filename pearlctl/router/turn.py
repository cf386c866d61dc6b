"""One turn: a caller's request and everything generated for it so far, across the parts that workers
served, folded into the caller's ONE answer. No I/O here: the gateway (pearlctl.router.gateway) sends each
part upstream and hands back what came; this module says what the next part asks for and what the caller gets.

Guarantees:
- **What can be continued.** A single-choice request (``n`` 1, one prompt, no ``echo``; chat without tools
  or structured output) is continued from token ids; anything else (`Turn.why_not`) is sent again whole
  (``pearl.restarted``) while nothing of it has reached the caller.
- **A continuation.** The prompt's token ids (vLLM returns them with ``return_token_ids``, which every part
  asks for) plus the token ids generated so far become the new prompt, with the remaining ``max_tokens``
  (``min_tokens`` less what was generated). A chat turn continues through ``/v1/completions`` on the chat
  prompt's token ids and is answered chat-shaped. Greedy decoding continued from token ids gives exactly the
  tokens of an uninterrupted run (tests/engines/test_router_engine.py checks it against real vLLM); penalties
  on generated tokens (presence/frequency) and stop strings that straddle an interruption are the documented
  exceptions.
- **One answer.** One stream that goes on, or one body: texts (the continued parts' detokenized by the
  gateway, pearlctl.router.text) and token ids joined, logprobs joined (text offsets shifted), usage summed,
  and a ``pearl`` field recording every part's token count and weight version, how many times it was
  continued and how many attempts it took.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from pearlctl.router.errors import GiveUp
from pearlctl.router.text import TextMirror

COMPLETION_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens: OpenAI's default, and vLLM 0.32's
# Fields of a chat request that a /v1/completions continuation keeps (the rest is chat-only: messages,
# tools, templates, response formats; or set by the gateway: prompt, max_tokens, min_tokens, logprobs).
CHAT_TO_COMPLETION = tuple(
    "model temperature top_p top_k min_p seed stop stop_token_ids ignore_eos skip_special_tokens "
    "spaces_between_special_tokens include_stop_str_in_output repetition_penalty presence_penalty "
    "frequency_penalty length_penalty logit_bias allowed_token_ids bad_words user priority stream "
    "stream_options cache_salt vllm_xargs return_tokens_as_token_ids".split()
)
# Fields of a completions request that a continuation drops (it sets its own, or they applied to the prompt).
COMPLETION_DROPPED = tuple(
    "prompt max_tokens min_tokens echo suffix prompt_logprobs truncate_prompt_tokens request_id "
    "add_special_tokens".split()
)
STRUCTURED = tuple(
    "response_format structured_outputs guided_json guided_regex guided_choice guided_grammar "
    "guided_decoding_backend".split()
)


def _continuable(kind: str, body: dict) -> str | None:
    """Why this request cannot be continued from token ids (None: it can)."""
    if body.get("n") not in (None, 1):
        return "n > 1"
    if body.get("best_of") not in (None, 1):
        return "best_of > 1"
    if body.get("echo"):
        return "echo"
    if kind == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(type(t) is int for t in prompt))):
            return "more than one prompt"
        if body.get("suffix"):
            return "suffix"
        if body.get("prompt_embeds") is not None:
            return "prompt_embeds"
    else:
        if body.get("tools") and body.get("tool_choice", "auto") != "none":
            return "tools"
    for name in STRUCTURED:
        value = body.get(name)
        if value and not (name == "response_format" and isinstance(value, dict) and value.get("type") == "text"):
            return name
    return None


def _shift_offsets(lp: Any, by: int) -> Any:
    if not isinstance(lp, dict) or not by or not lp.get("text_offset"):
        return lp
    return {**lp, "text_offset": [o + by for o in lp["text_offset"]]}


def chat_logprobs(lp: Any, top: int) -> list[dict]:
    """Completions-style logprobs (tokens, token_logprobs, top_logprobs) as chat ``logprobs.content``."""
    if not isinstance(lp, dict):
        return []
    tokens = lp.get("tokens") or []
    values = lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or []
    out = []
    for i, tok in enumerate(tokens):
        alts = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        best = sorted(alts.items(), key=lambda kv: -(kv[1] if kv[1] is not None else -1e30))[:top]
        out.append(
            {
                "token": tok,
                "logprob": values[i] if i < len(values) else None,
                "bytes": list(str(tok).encode("utf-8", errors="replace")),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": list(str(t).encode("utf-8", errors="replace"))} for t, v in best
                ],
            }
        )
    return out


@dataclass
class Turn:
    """One caller request and everything generated for it so far, across parts."""

    kind: str  # "completions" | "chat"
    body: dict
    session: str | None
    retry_for_s: float
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.stream = bool(self.body.get("stream"))
        self.want_ids = bool(self.body.get("return_token_ids"))
        self.why_not = _continuable(self.kind, self.body)
        if self.kind == "chat":
            mt = self.body.get("max_completion_tokens")
            mt = mt if mt is not None else self.body.get("max_tokens")
        else:
            mt = self.body.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
        self.max_tokens: int | None = mt if isinstance(mt, int) and not isinstance(mt, bool) else None
        so = self.body.get("stream_options")
        self.include_usage = bool(isinstance(so, dict) and so.get("include_usage"))
        lp = self.body.get("logprobs")
        self.top_logprobs = int(self.body.get("top_logprobs") or 0) if self.kind == "chat" else 0
        self.want_logprobs = bool(lp) if self.kind == "chat" else lp is not None
        self.progress_at = self.started
        self.prompt_ids: list[int] | None = None
        self.attempts = 0
        self.failures_in_row = 0
        self.continued = 0
        self.restarted = 0
        self.last_error = ""
        self.parts: list[dict] = []
        self.prefill_tokens = 0
        self.emitted = False  # anything streamed to the caller
        self.sent_prompt_ids = False
        self.no_wait = False  # the next attempt goes at once (an abort that made progress)
        self.mirror: TextMirror | None = None  # the continued parts' text, detokenized here (router/text.py)
        self.mirror_tried = False
        self._reset_output()

    def _reset_output(self) -> None:
        self.ids: list[int] = []
        self.texts: list[str] = []
        self.text_len = 0
        self.part_start_len = 0
        self.tokens = 0  # generated tokens kept (len(ids) when token ids come back)
        self.lp_completion: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        self.lp_chat: list[dict] = []
        self.template: dict | None = None  # the first answer in the caller's shape (non-streaming)
        self.head: dict | None = None  # id, created, model of the caller's answer
        self.prompt_tokens: int | None = None
        self.stop_reason: Any = None

    @property
    def continuable(self) -> bool:
        return self.why_not is None

    def remaining(self) -> int | None:
        return None if self.max_tokens is None else self.max_tokens - self.tokens

    def is_continuation(self) -> bool:
        return self.continuable and self.tokens > 0 and self.prompt_ids is not None

    def request(self) -> tuple[str, dict, bool]:
        """(path, body, is a continuation) of the next upstream attempt."""
        self.part_start_len = self.text_len  # vLLM's text offsets count from the start of a part's output
        if not self.is_continuation():
            body = {k: v for k, v in self.body.items() if k != "session"}
            if self.continuable:
                body["return_token_ids"] = True
            return f"/v1/{'chat/completions' if self.kind == 'chat' else 'completions'}", body, False
        assert self.prompt_ids is not None
        if self.kind == "chat":
            body = {k: self.body[k] for k in CHAT_TO_COMPLETION if k in self.body}
            if self.body.get("logprobs"):
                body["logprobs"] = self.top_logprobs
        else:
            body = {k: v for k, v in self.body.items() if k not in COMPLETION_DROPPED and k != "session"}
        body["prompt"] = self.prompt_ids + self.ids
        left = self.remaining()
        if left is not None:
            body["max_tokens"] = left
        min_tokens = self.body.get("min_tokens")
        if isinstance(min_tokens, int) and min_tokens > 0:
            body["min_tokens"] = max(0, min_tokens - self.tokens)
        body["return_token_ids"] = True
        return "/v1/completions", body, True

    # -- outcomes of an attempt -------------------------------------------------------------------
    def failed(self, why: str) -> None:
        self.last_error = why
        self.failures_in_row += 1
        self.no_wait = False

    def interrupted(self, why: str, part_tokens: int) -> None:
        """A part ended without finishing (an abort, a broken stream): keep what it made, or start over."""
        self.last_error = why
        if part_tokens > 0:
            self.failures_in_row = 0
            self.no_wait = True
        else:
            self.failures_in_row += 1
            self.no_wait = False
        if self.tokens > 0:
            if self.continuable and self.prompt_ids is not None:
                self.continued += 1 if part_tokens > 0 else 0
            else:
                self.restarted += 1
                self._reset_output()
                self.parts = []

    def progress(self, tokens: int) -> None:
        if tokens:
            self.progress_at = time.monotonic()

    def give_up(self) -> GiveUp:
        waited = time.monotonic() - self.started
        doc = {
            "message": (
                f"no worker completed this request: gave up {waited:.1f} s after it began, "
                f"{time.monotonic() - self.progress_at:.1f} s after its last progress (retry_for_s "
                f"{self.retry_for_s:g}), after {self.attempts} attempt(s) and {self.continued} continuation(s) "
                f"with {self.tokens} token(s) generated; last error: {self.last_error or 'none'}"
            ),
            "type": "pearl_retry_exhausted",
            "code": 503,
            "seconds": round(waited, 3),
            "retry_for_s": self.retry_for_s,
            "attempts": self.attempts,
            "continued": self.continued,
            "tokens_generated": self.tokens,
            "last_error": self.last_error,
        }
        return GiveUp(doc)

    def add_part(self, tokens: int, finish: str | None, who: dict) -> None:
        if tokens > 0 or finish not in (None, "abort"):
            self.parts.append({"tokens": tokens, "finish_reason": finish, **who})

    def pearl(self) -> dict:
        versions = sorted({p["weight_version"] for p in self.parts if p.get("weight_version")})
        out: dict[str, Any] = {
            "parts": self.parts,
            "continued": self.continued,
            "attempts": self.attempts,
            "restarted": self.restarted,
            "weight_versions": versions,
            "ambiguous": any(p.get("version_from") != "worker" and p.get("weight_version") is None for p in self.parts),
            "prefill_tokens": self.prefill_tokens,
        }
        if self.why_not is not None:
            out["not_continuable"] = self.why_not
        if self.continued:  # who made the continued parts' text (pearlctl.router.text)
            out["continued_text"] = "gateway" if self.mirror is not None else "vllm"
        return out

    def usage(self) -> dict:
        prompt = self.prompt_tokens if self.prompt_tokens is not None else len(self.prompt_ids or [])
        return {"prompt_tokens": prompt, "completion_tokens": self.tokens, "total_tokens": prompt + self.tokens}

    # -- non-streaming ----------------------------------------------------------------------------
    def take_answer(self, doc: dict, continuation: bool) -> tuple[int, str | None]:
        """Fold one part's whole answer in; returns (its tokens, its finish_reason)."""
        choice = doc["choices"][0]
        chat_shaped = self.kind == "chat" and not continuation
        if self.template is None and (chat_shaped or self.kind == "completions"):
            self.template = doc
        if self.head is None:
            self.head = {"id": doc.get("id"), "created": doc.get("created"), "model": doc.get("model")}
        usage = doc.get("usage") or {}
        if self.prompt_tokens is None and not continuation and isinstance(usage.get("prompt_tokens"), int):
            self.prompt_tokens = usage["prompt_tokens"]
        self.prefill_tokens += int(usage.get("prompt_tokens") or 0)
        prompt_ids = doc.get("prompt_token_ids") if chat_shaped else choice.get("prompt_token_ids")
        if self.prompt_ids is None and not continuation and isinstance(prompt_ids, list):
            self.prompt_ids = list(prompt_ids)
        if chat_shaped:
            text = (choice.get("message") or {}).get("content") or ""
            lp = choice.get("logprobs")
            if isinstance(lp, dict):
                self.lp_chat.extend(lp.get("content") or [])
        else:
            text = self._text(choice, choice.get("token_ids"), continuation)
            lp = choice.get("logprobs")
            if isinstance(lp, dict):
                if self.kind == "chat":
                    self.lp_chat.extend(chat_logprobs(lp, self.top_logprobs))
                else:
                    shifted = _shift_offsets(lp, self.part_start_len)
                    for k in self.lp_completion:
                        self.lp_completion[k].extend(shifted.get(k) or [])
        ids = choice.get("token_ids")
        n = len(ids) if isinstance(ids, list) else int(usage.get("completion_tokens") or 0)
        if isinstance(ids, list):
            self.ids.extend(ids)
        self.texts.append(text)
        self.text_len += len(text)
        self.tokens += n
        self.stop_reason = choice.get("stop_reason")
        self.progress(n)
        return n, choice.get("finish_reason")

    def _text(self, choice: dict, ids: Any, continuation: bool) -> str:
        """A /v1/completions part's text: vLLM's, or for a continued part the mirror's (router/text.py)."""
        if not (continuation and self.mirror is not None and isinstance(ids, list)):
            return choice.get("text") or ""
        finish, stop_reason = choice.get("finish_reason"), choice.get("stop_reason")
        by_token = finish == "stop" and not isinstance(stop_reason, str)  # EOS or a stop token id ended it
        if ids and by_token and not self.body.get("include_stop_str_in_output"):
            ids = ids[:-1]  # vLLM does not detokenize that last token
        return self.mirror.text(ids)

    def answer(self, finish: str | None) -> dict:
        """The caller's one body, from every part."""
        # a shallow copy: every field of the template that is changed below is replaced, never mutated
        doc = dict(self.template) if self.template is not None else {}
        choice = dict((doc.get("choices") or [{}])[0])
        text = "".join(self.texts)
        if self.kind == "chat":
            message = dict(choice.get("message") or {"role": "assistant"})
            message["content"] = text
            choice["message"] = message
            choice["logprobs"] = {"content": self.lp_chat} if self.want_logprobs else None
            doc.pop("prompt_token_ids", None)
            if self.want_ids:
                doc["prompt_token_ids"] = self.prompt_ids
        else:
            choice["text"] = text
            choice["logprobs"] = self.lp_completion if self.want_logprobs else None
            choice.pop("prompt_token_ids", None)
            if self.want_ids:
                choice["prompt_token_ids"] = self.prompt_ids
        choice.pop("token_ids", None)
        if self.want_ids:
            choice["token_ids"] = self.ids
        choice["finish_reason"] = finish
        choice["stop_reason"] = self.stop_reason
        choice["index"] = 0
        doc["choices"] = [choice]
        doc.update(self.head or {})
        doc["usage"] = self.usage()
        doc["pearl"] = self.pearl()
        return doc

    # -- streaming --------------------------------------------------------------------------------
    def take_chunk(self, obj: dict, continuation: bool) -> tuple[dict | None, int, str | None]:
        """One upstream stream event → (the caller's chunk or None, tokens in it, its finish_reason)."""
        choices = obj.get("choices") or []
        usage = obj.get("usage")
        if isinstance(usage, dict) and not choices:
            if self.prompt_tokens is None and not continuation and isinstance(usage.get("prompt_tokens"), int):
                self.prompt_tokens = usage["prompt_tokens"]
            self.prefill_tokens += int(usage.get("prompt_tokens") or 0)
            return None, 0, None
        if not choices:
            return None, 0, None
        ch = choices[0]
        chat_shaped = self.kind == "chat" and not continuation
        if self.head is None:
            self.head = {"id": obj.get("id"), "created": obj.get("created"), "model": obj.get("model")}
        prompt_ids = obj.get("prompt_token_ids") if chat_shaped else ch.get("prompt_token_ids")
        if self.prompt_ids is None and not continuation and isinstance(prompt_ids, list):
            self.prompt_ids = list(prompt_ids)
        ids = ch.get("token_ids") if isinstance(ch.get("token_ids"), list) else []
        if chat_shaped:
            delta = ch.get("delta") or {}
            text = delta.get("content") or ""
        else:
            delta = None
            text = self._text(ch, ch.get("token_ids"), continuation)
        lp = ch.get("logprobs")
        n = len(ids) if ids or "token_ids" in ch else (1 if text else 0)
        self.ids.extend(ids)
        self.tokens += n
        self.texts.append(text)
        self.text_len += len(text)
        self.progress(n)
        finish = ch.get("finish_reason")
        if "stop_reason" in ch:
            self.stop_reason = ch.get("stop_reason")
        out_finish = None if finish == "abort" else finish
        role = bool(delta and delta.get("role"))
        if not text and not ids and out_finish is None and not role and not lp:
            return None, n, finish
        head = self.head or {}
        if self.kind == "chat":
            if chat_shaped:
                choice = {k: v for k, v in ch.items() if k not in ("token_ids", "finish_reason")}
            else:
                choice = {"index": 0, "delta": {"content": text}}
                if lp:
                    choice["logprobs"] = {"content": chat_logprobs(lp, self.top_logprobs)}
            obj_name = "chat.completion.chunk"
        else:
            choice = {k: v for k, v in ch.items() if k not in ("token_ids", "prompt_token_ids", "finish_reason")}
            choice["text"] = text
            if lp:
                choice["logprobs"] = _shift_offsets(lp, self.part_start_len)
            obj_name = "text_completion"
        choice["index"] = 0
        choice["finish_reason"] = out_finish
        if self.want_ids:
            choice["token_ids"] = ids
        chunk: dict[str, Any] = {
            "id": head.get("id"),
            "object": obj_name,
            "created": head.get("created"),
            "model": head.get("model"),
            "choices": [choice],
        }
        if self.want_ids and not self.sent_prompt_ids and self.prompt_ids is not None:
            if self.kind == "chat":
                chunk["prompt_token_ids"] = self.prompt_ids
            else:
                choice["prompt_token_ids"] = self.prompt_ids
            self.sent_prompt_ids = True
        return chunk, n, finish

    def final_chunks(self, chunk: dict | None, finish: str) -> list[dict]:
        """The caller's last chunk (with ``pearl``) and, if asked for, the summed usage."""
        head = self.head or {}
        if chunk is None:
            obj_name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
            empty = {"index": 0, "delta": {}} if self.kind == "chat" else {"index": 0, "text": ""}
            chunk = {
                "id": head.get("id"),
                "object": obj_name,
                "created": head.get("created"),
                "model": head.get("model"),
                "choices": [empty],
            }
        chunk["choices"][0]["finish_reason"] = finish
        chunk["pearl"] = self.pearl()
        out = [chunk]
        if self.include_usage:
            out.append(
                {
                    "id": head.get("id"),
                    "object": chunk["object"],
                    "created": head.get("created"),
                    "model": head.get("model"),
                    "choices": [],
                    "usage": self.usage(),
                }
            )
        return out


def sse(obj: dict | str) -> bytes:
    """One server-sent event of the caller's stream: ``data: <JSON>``, or a literal such as ``[DONE]``."""
    return b"data: " + (obj.encode() if isinstance(obj, str) else orjson.dumps(obj)) + b"\n\n"
