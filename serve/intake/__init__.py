"""Request intake: validation, image policy, SSRF-safe URL fetching, prompt-length check.

- ``request`` / ``responses``: the body rules of chat completions and completions / of the
  Responses API (pure: standard library only);
- ``images``: the image policy (Pillow); ``cache``: prepared images by content hash;
  ``workers``: the same image work in a process pool (``--image-workers``);
- ``urls``: SSRF-safe image URL fetching (httpx); ``budget``: the prompt-length check;
- ``middleware``: the ASGI layer; ``service``: :class:`~serve.intake.service.Intake`, the
  policy of one API process built from :class:`~serve.settings.Settings`.

The package imports nothing itself, so the pure rules load without Pillow or torch.
"""
