"""The route table: what every path of vLLM's OpenAI app gets from this server (pure data).

vLLM's app serves ~35 routes, from chat completions to elastic scaling. A route this table does
not name is closed, and ``tests/engine/test_routes_live.py`` builds vLLM's real app and fails
on any route it does not classify, so a vLLM upgrade can never open a door silently.

Policies:

- ``generate``: the full request path (auth -> body limit -> intake -> admission -> stream
  guard -> vLLM): image caps before decoding, placeholder neutralisation, the live
  ``max_num_seqs``, goodput accounting.
- ``served``: read-only information vLLM answers as is, behind auth (model list, version).
- ``optional``: closed (404) unless named in ``--open-routes``; then served as vLLM answers
  it, behind auth and the body limit but **without** intake or admission (their bodies are
  not chat completions). For operators who need them and accept that.
- ``closed``: always 404: administration, scaling, batch and token-level routes that would
  bypass every guarantee above.

Our own routes (``/health``, ``/ready``, ``/metrics``, ``/limits``, ``/admin/autotuner``) are
answered before this table is consulted (``serve.app``); vLLM's ``/health`` and ``/metrics``
are shadowed by them.
"""

from __future__ import annotations

import re

GENERATE, SERVED, OPTIONAL, CLOSED = "generate", "served", "optional", "closed"
POLICIES = (GENERATE, SERVED, OPTIONAL, CLOSED)

#: Wire protocols of the generation routes: request shape and SSE dialect.
CHAT, COMPLETIONS, RESPONSES = "chat", "completions", "responses"
#: Every ``generate`` route (``POST``) and its protocol.
GENERATION_ROUTES: dict[str, str] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETIONS,
    "/v1/responses": RESPONSES,
}

#: Every route of vLLM 0.32's OpenAI app (path templates as vLLM declares them).
VLLM_ROUTES: dict[str, str] = {
    **{path: GENERATE for path in GENERATION_ROUTES},
    "/v1/models": SERVED,
    "/version": SERVED,
    "/ping": SERVED,  # SageMaker-style liveness (GET and POST), no body
    "/load": SERVED,  # vLLM's count of requests in its server
    # Shadowed by our own routes.
    "/health": SERVED,
    "/metrics": SERVED,
    # Closed unless --open-routes: no intake, no admission. Stored responses need vLLM's
    # response store (off by default), so retrieving and cancelling them are closed too.
    "/v1/responses/{response_id}": OPTIONAL,
    "/v1/responses/{response_id}/cancel": OPTIONAL,
    "/v1/messages": OPTIONAL,
    "/v1/messages/count_tokens": OPTIONAL,
    "/invocations": OPTIONAL,
    "/tokenize": OPTIONAL,
    "/detokenize": OPTIONAL,
    "/v1/chat/completions/render": OPTIONAL,
    "/v1/chat/completions/derender": OPTIONAL,
    "/v1/completions/render": OPTIONAL,
    "/v1/completions/derender": OPTIONAL,
    "/v1/messages/render": OPTIONAL,
    "/v1/responses/render": OPTIONAL,
    "/docs": OPTIONAL,
    "/docs/oauth2-redirect": OPTIONAL,
    "/openapi.json": OPTIONAL,
    "/redoc": OPTIONAL,
    # Always closed.
    "/v1/chat/completions/batch": CLOSED,
    "/inference/v1/generate": CLOSED,
    "/inference/v1/abort_requests": CLOSED,
    "/generative_scoring": CLOSED,
    "/is_scaling_elastic_ep": CLOSED,
    "/scale_elastic_ep": CLOSED,
    "/kv_event_sources": CLOSED,
    "/v1/systemone": CLOSED,
}


def _pattern(template: str) -> re.Pattern:
    """A regex for a path template (``{name}`` matches one path segment)."""
    return re.compile("^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)) + "$")


class RouteTable:
    """Looks up the policy of a request path.

    Args:
        open_routes: ``optional`` route templates the operator opened (``--open-routes``).

    Raises:
        ValueError: an entry of ``open_routes`` is not an ``optional`` route.
    """

    def __init__(self, open_routes: list[str] | tuple[str, ...] = ()) -> None:
        bad = [r for r in open_routes if VLLM_ROUTES.get(r) != OPTIONAL]
        if bad:
            allowed = ", ".join(k for k, v in VLLM_ROUTES.items() if v == OPTIONAL)
            raise ValueError(f"--open-routes accepts only {allowed}; not {', '.join(bad)}")
        self.policies = {path: (SERVED if path in open_routes else policy)
                         for path, policy in VLLM_ROUTES.items()}
        self._templates = [(_pattern(t), t) for t in self.policies if "{" in t]

    def policy(self, path: str) -> str:
        """The policy of ``path`` (a request path, not a template); unknown paths are closed."""
        template = self.template(path)
        return CLOSED if template is None else self.policies[template]

    def template(self, path: str) -> str | None:
        """The route template ``path`` (a request path) matches, None when it matches none."""
        if path in self.policies and "{" not in path:
            return path
        for pattern, template in self._templates:
            if pattern.match(path):
                return template
        return None

    def unclassified(self, templates) -> list[str]:
        """The route templates of an app that this table does not name (sorted)."""
        return sorted({t for t in templates if t not in VLLM_ROUTES})
