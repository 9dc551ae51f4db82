"""The UI's HTTP server (Chainlit's uvicorn): the keep-alive Chainlit gives no way to set.

Chainlit 2.12 starts uvicorn in ``chainlit.cli.run_chainlit`` (both ``python -m ui`` and
``chainlit run`` go through it): it loads the app module (``ui/app.py``), then builds
``uvicorn.Config(app, host=..., port=..., ws=..., log_level=..., ssl_*=...)`` itself. Nothing
there sets ``timeout_keep_alive``, and no environment variable does (uvicorn's ``UVICORN_*``
variables belong to its own command line, not to ``Config``), so idle connections would close
after uvicorn's default 5 s: before a proxy in front drops them from its pool (nginx 60 s, AWS
ALB 60 s, Envoy 3600 s), which then sends the next request on a connection the UI is closing
(a reset, a 502). :func:`set_keep_alive` therefore gives ``chainlit.cli`` a ``uvicorn`` whose
``Config`` defaults ``timeout_keep_alive`` to the UI's setting; it changes nothing else, and
nothing outside ``chainlit.cli``. It must run before ``run_chainlit`` builds the config: the
app module does, as Chainlit loads it first. ``tests/unit/test_ui_server.py`` checks it on
the running UI, through both entry points.
"""

from __future__ import annotations

import types

import uvicorn


def keep_alive_config(seconds: float) -> type[uvicorn.Config]:
    """``uvicorn.Config`` with ``timeout_keep_alive`` defaulting to ``seconds`` (a value the
    caller passes still wins)."""

    class Config(uvicorn.Config):
        def __init__(self, *args, **kwargs) -> None:
            kwargs.setdefault("timeout_keep_alive", seconds)
            super().__init__(*args, **kwargs)

    return Config


def set_keep_alive(seconds: float) -> None:
    """Make the uvicorn server Chainlit starts in this process keep idle connections open
    ``seconds`` between requests. Raises ``RuntimeError`` if ``chainlit.cli`` no longer builds
    its server from a module-level ``uvicorn`` (a Chainlit upgrade: the setting would be
    silently lost)."""
    import chainlit.cli as chainlit_cli

    if not isinstance(getattr(chainlit_cli, "uvicorn", None), types.ModuleType):
        raise RuntimeError("chainlit.cli has no module-level uvicorn: PHI3V_UI_KEEP_ALIVE_S "
                           "cannot apply (ui/serving.py)")
    # A copy of the real module (not the one chainlit.cli holds: a second call, e.g. Chainlit's
    # --watch reloading the app, replaces the first) with only Config changed.
    shim = types.ModuleType(uvicorn.__name__, uvicorn.__doc__)
    shim.__dict__.update(vars(uvicorn))
    shim.Config = keep_alive_config(seconds)
    chainlit_cli.uvicorn = shim
