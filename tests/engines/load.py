"""Client load for engine tests of a run's data plane: threads sending greedy completions back to back
through the run's one base URL (its gateway) until stopped, half of them streamed, each turn a fresh
session. Every outcome is kept — turns sent, completed (with their token ids, the workers that served
their parts, and how often they were continued on another worker) and errors — so a test counts expected
against completed instead of trusting a status code.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx

from pearlctl.router import service
from tests.conftest import wait_for

SENTENCE = "the cat sat on the mat and looked at the sea, then it walked home along the old stone wall. "


def prompts(n: int = 4, repeat: int = 6) -> list[str]:
    """``n`` distinct chat-formatted prompts of the tiny model, each ``repeat`` sentences long."""
    return [f"<|im_start|>user\nstory {i}: {SENTENCE * repeat}<|im_end|>\n<|im_start|>assistant\n" for i in range(n)]


class Load:
    """``threads`` client threads sending greedy completions of ``tokens`` tokens (``ignore_eos``) through
    the run's base URL until stopped, naming ``model`` (default: the first the gateway lists, the policy's; a
    judge's name sends them to the run's judge); use as a context manager."""

    def __init__(self, run_dir: Path, *, prompts: list[str], tokens: int, threads: int = 4, model: str | None = None):
        record = service.read_record(run_dir)
        self.base, self.key = record.base_url, service.read_key(run_dir)
        self.prompts, self.tokens = prompts, tokens
        if model is None:
            models = httpx.get(self.base + "/models", headers={"Authorization": f"Bearer {self.key}"}, timeout=30)
            assert models.status_code == 200, models.text
            model = models.json()["data"][0]["id"]
        self.model = model
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.sent = 0
        self.done: list[dict] = []
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self.loop, args=(i,), daemon=True) for i in range(threads)]

    def turn(self, prompt: int, session: str, stream: bool) -> dict:
        """One greedy turn: its token ids and the gateway's ``pearl`` record (parts, continued)."""
        body = {
            "model": self.model,
            "prompt": self.prompts[prompt],
            "max_tokens": self.tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": stream,
        }
        headers = {"Authorization": f"Bearer {self.key}", "X-Session-ID": session}
        if not stream:
            resp = httpx.post(self.base + "/completions", json=body, headers=headers, timeout=300)
            assert resp.status_code == 200, resp.text
            doc = resp.json()
            return {"ids": doc["choices"][0]["token_ids"], "pearl": doc["pearl"]}
        ids, pearl = [], {}
        with httpx.stream("POST", self.base + "/completions", json=body, headers=headers, timeout=300) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    event = json.loads(line[5:])
                    pearl = event.get("pearl", pearl)
                    for c in event.get("choices") or []:
                        ids += c.get("token_ids") or []
        return {"ids": ids, "pearl": pearl}

    def references(self) -> list[list[int]]:
        """Each prompt's token ids from one uninterrupted greedy turn."""
        return [self.turn(i, f"ref-{i}", stream=False)["ids"] for i in range(len(self.prompts))]

    def loop(self, thread: int) -> None:
        n = 0
        while not self.stop.is_set():
            prompt, session = (n + thread) % len(self.prompts), f"load-{thread}-{n}"
            n += 1
            with self.lock:
                self.sent += 1
            try:
                out = self.turn(prompt, session, stream=thread % 2 == 1)
            except Exception as exc:  # counted: the tests fail on any
                with self.lock:
                    self.errors.append(f"{session}: {type(exc).__name__}: {exc}")
                continue
            parts = out["pearl"].get("parts") or []
            with self.lock:
                self.done.append(
                    {
                        "prompt": prompt,
                        "ids": out["ids"],
                        "continued": out["pearl"].get("continued", 0),
                        "workers": [p.get("worker") for p in parts],
                    }
                )

    def wait_turns(self, n: int, timeout: float = 300) -> None:
        """Until ``n`` more turns completed than when called."""
        mark = len(self.done)
        wait_for(lambda: len(self.done) - mark >= n, timeout, every=0.2)

    def continued(self) -> list[dict]:
        return [o for o in self.done if o["continued"]]

    def counts(self) -> str:
        """Expected against completed, for the test's printout."""
        return (
            f"turns sent {self.sent}, completed {len(self.done)}, errors {len(self.errors)}, "
            f"continued on another worker {len(self.continued())}"
        )

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)
