"""Per-answer statistics shown under each answer: TTFT, decode speed, token counts.

Definitions (client-side, as a user experiences them):

- **TTFT**: seconds from sending the request to the first streamed content token (queueing,
  image preprocessing and prefill included).
- **tokens**: ``usage.completion_tokens`` from the final stream chunk
  (``stream_options.include_usage``); streamed content chunks when the server sent no usage
  (a stopped answer).
- **tok/s**: decode speed, tokens after the first one divided by the seconds after the first
  one (TTFT excluded, so a long prefill does not hide a fast decode).

No Chainlit import: unit-tested in the main test environment.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class AnswerStats:
    """Timing and token counts of one streamed answer. Feed it events as they arrive."""

    clock: Callable[[], float] = time.monotonic
    started_at: float = field(default=0.0)
    first_token_at: float | None = None
    last_token_at: float | None = None
    chunks: int = 0
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    stopped: bool = False

    def __post_init__(self) -> None:
        self.started_at = self.clock()

    def on_token(self) -> None:
        """A content chunk arrived."""
        now = self.clock()
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        self.chunks += 1

    def on_usage(self, usage: dict) -> None:
        """The stream's ``usage`` object arrived (last chunk)."""
        self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
        self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started_at

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.chunks

    @property
    def tokens_per_s(self) -> float | None:
        if self.first_token_at is None or self.last_token_at is None or self.tokens < 2:
            return None
        span = self.last_token_at - self.first_token_at
        return (self.tokens - 1) / span if span > 0 else None

    def to_dict(self) -> dict:
        """JSON-able summary (persisted in the answer's metadata)."""
        return {"ttft_s": self.ttft_s, "tokens_per_s": self.tokens_per_s,
                "tokens": self.tokens, "prompt_tokens": self.prompt_tokens,
                "stopped": self.stopped}

    def line(self) -> str:
        """One line for under the answer, e.g.
        ``TTFT 0.42 s · 9.8 tok/s · 24 tokens · prompt 330 tokens``."""
        parts = [f"TTFT {self.ttft_s:.2f} s" if self.ttft_s is not None else "TTFT –",
                 f"{self.tokens_per_s:.1f} tok/s" if self.tokens_per_s is not None
                 else "– tok/s",
                 f"{self.tokens} tokens"]
        if self.prompt_tokens is not None:
            parts.append(f"prompt {self.prompt_tokens} tokens")
        if self.stopped:
            parts.append("stopped")
        return " · ".join(parts)
