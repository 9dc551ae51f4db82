"""The intake policy of one API process, built from :class:`~serve.settings.Settings`."""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass

from serve.intake.budget import PromptBudget
from serve.intake.cache import ImageCache
from serve.intake.images import ImagePolicy
from serve.intake.middleware import IntakeMiddleware
from serve.intake.request import RequestLimits
from serve.intake.urls import UrlPolicy
from serve.intake.workers import ImageWorkers
from serve.settings import Settings


@dataclass
class Intake:
    """The intake policy of one API process, built from :class:`Settings`."""

    limits: RequestLimits
    images: ImagePolicy
    urls: UrlPolicy
    cache: ImageCache
    default_num_crops: int
    default_max_tokens: int
    budget: PromptBudget | None = None
    #: The process pool images are prepared in (``--image-workers``); None: worker threads.
    workers: ImageWorkers | None = None
    #: Access records carry the request's content (``--enable-log-requests``, ``serve.logs``).
    log_content: bool = False

    @classmethod
    def from_settings(cls, settings: Settings) -> "Intake":
        s = settings.resolved()
        return cls(
            RequestLimits(max_images=s.max_images_per_prompt, max_n=s.max_n,
                          max_num_crops=s.max_num_crops, tools=s.tools),
            ImagePolicy(s.max_image_bytes, s.max_image_pixels,
                        frozenset(f.upper() for f in s.image_formats)),
            UrlPolicy(enabled=s.image_urls,
                      allowlist=tuple(h.lower().strip("[]").rstrip(".")
                                      for h in s.image_url_allowlist),
                      allowed_networks=tuple(ipaddress.ip_network(n, strict=False)
                                             for n in s.image_url_allowed_networks),
                      max_bytes=s.max_image_bytes, read_timeout_s=s.image_url_timeout_s,
                      total_timeout_s=s.image_url_timeout_s,
                      max_redirects=s.image_url_max_redirects),
            ImageCache(s.image_cache_bytes), s.num_crops, s.default_max_tokens,
            workers=ImageWorkers(s.image_workers) if s.image_workers else None,
            log_content=s.enable_log_requests)

    def wrap(self, app) -> IntakeMiddleware:
        """``app`` behind the intake (call :meth:`load_budget` first)."""
        return IntakeMiddleware(app, self.limits, self.images, self.urls, self.budget,
                                self.cache, self.default_num_crops, self.default_max_tokens,
                                self.workers, self.log_content)

    async def load_budget(self, engine, settings: Settings) -> None:
        """Attach the prompt-length check, with the engine's tokenizer and context length."""
        s = settings.resolved()
        tokenizer = await asyncio.to_thread(engine.get_tokenizer)
        self.budget = PromptBudget(tokenizer, engine.model_config.max_model_len, s.num_crops)
