"""The UI's one typed configuration: ``PHI3V_UI_*`` environment variables (or CLI flags of
``python -m ui``), defaults below.

Limits that belong to the server (image bytes, pixels, count, formats, ``num_crops``) are
**not** here: the UI reads them from the API's ``GET /limits`` (:mod:`ui.api`), so the two can
never drift. What is here is the UI's own policy: where the API is, how images are re-encoded,
how much image history a conversation carries, where conversations are stored, who may log in.

This module imports neither Chainlit nor the API, so it loads in any environment.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: The ``ui/`` directory (Chainlit's app root: ``.chainlit/config.toml``, ``chainlit.md``).
UI_DIR = Path(__file__).resolve().parent
#: Where the demo keeps its SQLite file, stored images and generated auth secret.
DATA_DIR = UI_DIR / ".data"


class UISettings(BaseSettings):
    """Settings of the Chainlit UI process. Units are in the field names or descriptions."""

    model_config = SettingsConfigDict(
        env_prefix="PHI3V_UI_",
        cli_prog_name="python -m ui",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_hide_none_type=True,
        cli_avoid_json=True,
        extra="ignore",
    )

    # --- where the UI listens and the API it talks to ------------------------------------
    host: str = Field("127.0.0.1", description="Address the UI binds to.")
    port: int = Field(8080, ge=1, le=65535, description="TCP port of the UI.")
    keep_alive_s: float = Field(
        3620.0,
        gt=0,
        description="Seconds the UI's HTTP server keeps an idle connection open between "
        "requests (uvicorn's timeout_keep_alive, 5 by default). Above the idle timeout of "
        "every proxy that may front the UI (Envoy-based ingresses and gateways 3600, Google "
        "Cloud load balancers 600, AWS ALB 60, nginx/ingress-nginx upstream keepalive_timeout "
        "60), so the proxy closes an idle connection first and never sends a request on one "
        "the UI is closing (a reset, then a 502). A proxy set longer needs this raised "
        "(deploy/: tested).",
    )
    api_base_url: str = Field(
        "http://127.0.0.1:8000",
        description="Base URL of the API (python -m serve), without /v1.",
    )
    api_key: str | None = Field(
        None, description="Bearer token sent to the API, if it requires one."
    )
    model: str | None = Field(
        None, description="Model name sent in requests; default: the one GET /limits names."
    )
    connect_timeout_s: float = Field(
        5.0, gt=0, description="Seconds to wait for a TCP connection to the API."
    )
    read_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Seconds to wait between two stream events (first token included) "
        "before giving up on an answer.",
    )
    api_keep_alive_s: float = Field(
        60.0,
        gt=0,
        description="Seconds an idle connection to the API is kept for the next request "
        "(httpx keepalive_expiry). Below the API's --http-keep-alive-timeout-s (3620), so the "
        "UI closes an idle connection before the API does and never reuses one the API is "
        "closing (deploy/: tested).",
    )
    limits_urls: list[str] = Field(
        [],
        description="Base URLs asked for GET /limits, the first that answers, when the API "
        "base URL is a router that does not forward it (vllm-router answers only the OpenAI "
        "routes): the replicas, or a Service over them (a JSON list). Empty: the API base URL.",
    )
    limits_ttl_s: float = Field(
        30.0, ge=0, description="Seconds GET /limits stays cached before it is asked again."
    )

    # --- image intake (the server's limits come from GET /limits) -------------------------
    max_image_side_px: int = Field(
        1344,
        ge=64,
        description="Images are downscaled so their longest side is at most this many pixels "
        "before they are sent (Phi-3-vision's HD transform works on 336-px tiles; 1344 = 4 "
        "tiles covers num_crops=16).",
    )
    jpeg_quality: int = Field(
        90, ge=50, le=100, description="Quality of re-encoded JPEGs (photos stay JPEG)."
    )
    history_max_images: int = Field(
        2,
        ge=0,
        description="Most images carried in the history sent to the model (the newest ones; "
        "older image parts become a short text note): the default of the chat setting "
        "'Images re-sent'. Capped by the server's max_images_per_request.",
    )

    # --- chat settings defaults (the user can change them per chat) -----------------------
    default_system_prompt: str = Field(
        "", description="Initial system prompt of a chat (sent first, as a system message, "
        "when not empty)."
    )
    default_temperature: float = Field(0.7, ge=0, le=2, description="Initial temperature.")
    default_max_tokens: int = Field(
        512, ge=1, description="Initial maximum answer length, tokens."
    )
    max_tokens_ceiling: int = Field(
        4096, ge=1, description="Largest maximum answer length a user may pick, tokens (also "
        "at most the server's max_model_len)."
    )

    # --- persistence and login -------------------------------------------------------------
    database_url: str = Field(
        f"sqlite+aiosqlite:///{DATA_DIR / 'chat.db'}",
        description="SQLAlchemy async URL of the conversation store: the embedded SQLite file "
        "by default, postgresql+asyncpg://user:pass@host/db in production.",
    )
    storage_dir: Path = Field(
        DATA_DIR / "files",
        description="Directory of the local storage client (persisted images).",
    )
    auth_secret_file: Path = Field(
        DATA_DIR / "auth_secret",
        description="Where the generated CHAINLIT_AUTH_SECRET is kept when none is set in the "
        "environment (demo only: set CHAINLIT_AUTH_SECRET in production).",
    )
    demo_user: str = Field("demo", description="Login name of the demo user.")
    demo_password: str = Field("demo", description="Password of the demo user.")

    # --- accounts (ui/README.md: running the UI for a team) ------------------------------------
    accounts: Literal["demo", "users-file", "oauth", "header"] = Field(
        "demo",
        description="Where logins come from: 'demo' (the one demo user above), 'users-file' "
        "(names and Argon2 hashes in --users-file, managed with python -m ui.users), 'oauth' "
        "(Chainlit's OAuth providers, configured by their OAUTH_* environment variables), "
        "'header' (a user name in --auth-header, set by an authenticating proxy at one of "
        "--trusted-proxies).",
    )
    users_file: Path = Field(
        DATA_DIR / "users.json", description="The users file of accounts=users-file."
    )
    auth_header: str = Field(
        "X-Forwarded-User",
        description="Request header holding the user name, with accounts=header.",
    )
    trusted_proxies: list[str] = Field(
        ["127.0.0.1/32", "::1/128"],
        description="Addresses or networks (CIDR) of the authenticating proxy: with "
        "accounts=header, a request from anywhere else is refused whatever its headers.",
    )
    oauth_allowed: list[str] = Field(
        [],
        description="With accounts=oauth, who may log in: e-mail addresses or logins, and "
        "'@domain' for a whole e-mail domain (a JSON list). Empty: nobody.",
    )
    login_max_failures: int = Field(
        5, ge=1, description="Failed logins allowed per user name and address in the window."
    )
    login_window_s: float = Field(
        900.0, gt=0, description="Window of login_max_failures, seconds."
    )
    user_quota_bytes: int = Field(
        200 * 2**20, ge=0,
        description="Bytes of stored images each user may keep (0: no limit); a message whose "
        "images would pass it is refused with the figures. Deleting a conversation deletes "
        "its images.",
    )

    # --- browsers: which pages may use a login (ui/README.md: origins and the login cookie) --
    allowed_origins: list[str] = Field(
        [],
        description="Origins (scheme://host[:port], as browsers send them in Origin) that may "
        "call the UI with a user's login cookie and open its websocket, besides the UI's own "
        "(the Host the request came to; behind a proxy, X-Forwarded-Proto/-Host): the public "
        "origin of a proxy that rewrites Host, a JSON list. Empty: the UI's own page only.",
    )
    cookie_secure: bool = Field(
        False,
        description="Mark the login cookie Secure (browsers send it over HTTPS only): set it "
        "when users reach the UI over HTTPS (a TLS-terminating proxy or ingress). Off by "
        "default: make ui / make demo serve plain HTTP, where browsers would drop it (except "
        "on localhost).",
    )

    @field_validator("allowed_origins")
    @classmethod
    def _origins_only(cls, origins: list[str]) -> list[str]:
        """Each entry is an origin exactly as a browser writes it: a wildcard, a path or a
        capital letter would never match (or, for ``*``, match every site)."""
        for origin in origins:
            parts = urlsplit(origin)
            if (parts.scheme not in ("http", "https") or not parts.hostname
                    or origin != f"{parts.scheme}://{parts.netloc}" or origin != origin.lower()
                    or "@" in parts.netloc):
                raise ValueError(f"{origin!r} is not an origin: write scheme://host[:port] in "
                                 "lower case, without a path (e.g. https://chat.example.com)")
        return origins

    def env(self) -> dict[str, str]:
        """These settings as ``PHI3V_UI_*`` variables (hand CLI flags to the Chainlit app)."""
        out = {}
        for name, value in self.model_dump().items():
            if value is not None:  # lists as JSON, as pydantic-settings reads them back
                out[f"PHI3V_UI_{name.upper()}"] = (json.dumps(value) if isinstance(value, list)
                                                   else str(value))
        return out
