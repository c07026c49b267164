"""A synthetic shared-prefix, multi-turn chat workload (deterministic for a seed).

A prompt is ``system prompt + document + turns``:

* a few **system prompts** shared by every conversation of their "app" (Zipf popularity);
* a larger set of **documents** (retrieved context) drawn with Zipf popularity, so a few are
  hot and most are cold;
* **follow-ups**: an open conversation comes back with its previous prompt, an answer and a
  new question appended, so each turn extends the prompt the cluster last saw for it.

Nothing here knows about engines or routers: :meth:`Workload.next_request` just returns the
next :class:`DemoRequest`, and the cluster decides where it goes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["DemoRequest", "Workload", "WorkloadConfig"]


@dataclass(slots=True)
class WorkloadConfig:
    seed: int = 0
    vocab_size: int = 32000
    system_prompts: int = 4
    system_tokens: tuple[int, int] = (96, 192)
    documents: int = 48
    document_tokens: tuple[int, int] = (256, 512)
    zipf_s: float = 1.1
    #: chance that the next request is a follow-up of an open conversation
    follow_up: float = 0.55
    max_turns: int = 6
    turn_tokens: tuple[int, int] = (16, 64)
    max_prompt_tokens: int = 1536
    #: open conversations kept (the oldest is closed when a new one would exceed this)
    open_conversations: int = 64
    max_new_tokens: tuple[int, int] = (2, 6)


@dataclass(slots=True)
class DemoRequest:
    req_id: str
    tokens: list[int]
    max_new_tokens: int
    conversation: int
    turn: int
    system: int
    document: int


@dataclass(slots=True)
class _Conversation:
    cid: int
    system: int
    document: int
    tokens: list[int]
    turns: int = 1


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (rank ** s) for rank in range(1, n + 1)]


class Workload:
    """Endless requests; ``follow_ups`` and ``new_conversations`` count what was generated."""

    def __init__(self, config: WorkloadConfig | None = None) -> None:
        self.cfg = cfg = config or WorkloadConfig()
        if cfg.system_prompts <= 0 or cfg.documents <= 0:
            raise ValueError("the workload needs at least one system prompt and one document")
        self._rng = rng = random.Random(cfg.seed)
        self.systems = [self._text(rng.randint(*cfg.system_tokens)) for _ in range(cfg.system_prompts)]
        self.docs = [self._text(rng.randint(*cfg.document_tokens)) for _ in range(cfg.documents)]
        self._sys_w = _zipf_weights(cfg.system_prompts, cfg.zipf_s)
        self._doc_w = _zipf_weights(cfg.documents, cfg.zipf_s)
        self._open: list[_Conversation] = []
        self._next_cid = 0
        self.requests = 0
        self.follow_ups = 0
        self.new_conversations = 0
        self.prompt_tokens = 0

    def _text(self, n: int) -> list[int]:
        v = self.cfg.vocab_size
        return [self._rng.randrange(v) for _ in range(n)]

    def next_request(self) -> DemoRequest:
        cfg, rng = self.cfg, self._rng
        conv = None
        if self._open and rng.random() < cfg.follow_up:
            conv = self._open[rng.randrange(len(self._open))]
            extra = self._text(rng.randint(*cfg.turn_tokens)) + self._text(rng.randint(*cfg.turn_tokens))
            if conv.turns >= cfg.max_turns or len(conv.tokens) + len(extra) > cfg.max_prompt_tokens:
                self._open.remove(conv)
                conv = None
            else:
                conv.tokens = conv.tokens + extra  # previous prompt + answer + new question
                conv.turns += 1
                self.follow_ups += 1
        if conv is None:
            s = rng.choices(range(cfg.system_prompts), self._sys_w)[0]
            d = rng.choices(range(cfg.documents), self._doc_w)[0]
            question = self._text(rng.randint(*cfg.turn_tokens))
            conv = _Conversation(self._next_cid, s, d, self.systems[s] + self.docs[d] + question)
            self._next_cid += 1
            self.new_conversations += 1
            self._open.append(conv)
            if len(self._open) > cfg.open_conversations:
                self._open.pop(0)
        self.requests += 1
        self.prompt_tokens += len(conv.tokens)
        return DemoRequest(f"c{conv.cid}t{conv.turns}", list(conv.tokens), rng.randint(*cfg.max_new_tokens),
                           conv.cid, conv.turns, conv.system, conv.document)
