"""Image URL fetching (``serve/intake/urls.py``) among concurrent fetches: each URL's failure
is its own request's 4xx, and no fetch holds up another.

The outside peer is a local test server (``tests.helpers.ImagePeer``): a PNG, a connection
that never answers, and one that drips a byte at a time.
"""

from __future__ import annotations

import asyncio
import ipaddress
import ssl
import time

import pytest

from serve.intake.errors import IntakeError
from serve.intake.urls import UrlPolicy, fetch_image_url
from tests.helpers import IMAGES, ImagePeer

PNG = (IMAGES / "chelsea.png").read_bytes()


@pytest.fixture(scope="module")
def peer():
    server = ImagePeer(PNG)
    yield server.base
    server.close()


def policy(total_timeout_s: float) -> UrlPolicy:
    return UrlPolicy(enabled=True, allowlist=("127.0.0.2",),
                     allowed_networks=(ipaddress.ip_network("127.0.0.2/32"),),
                     read_timeout_s=total_timeout_s, total_timeout_s=total_timeout_s)


async def outcome(url: str, pol: UrlPolicy):
    """The body's length, or the IntakeError's (status, message)."""
    try:
        return len(await fetch_image_url(url, pol, "messages[0].content[0].image_url"))
    except IntakeError as err:
        return err.status, err.message


@pytest.fixture
def loaded_tls_setup(monkeypatch):
    """A loaded machine: building a TLS context (it parses the whole CA bundle, on the event
    loop) takes 0.4 s instead of tens of milliseconds. The context is still really built."""
    build = ssl.create_default_context

    def slow(*args, **kwargs):
        time.sleep(0.4)
        return build(*args, **kwargs)

    monkeypatch.setattr(ssl, "create_default_context", slow)


async def test_a_valid_url_is_not_held_up_by_the_fetches_beside_it(peer, loaded_tls_setup):
    """The valid URL arrives first and 13 bad ones right after (hanging or dripping peers),
    under a 2.5-s deadline each. A fetch that sets up TLS per request stalled the event loop
    for all of them (13 x 0.4 s = 5.2 s here), so the valid one missed its deadline and got a
    400; with the context built once, with the policy, it gets its image every time. The
    deadline leaves the valid fetch (tens of milliseconds alone) room for a busy machine: at
    1 s it missed once in a full run with other work beside it."""
    pol = policy(2.5)  # built before the burst, as the server builds it at start
    for _ in range(2):
        urls = [f"{peer}/img.png"] + [f"{peer}/{'hang' if i % 2 else 'drip'}/{i}"
                                      for i in range(13)]
        results = await asyncio.gather(*(outcome(u, pol) for u in urls))
        assert results[0] == len(PNG), results[0]
        assert all(r == (400, "image URL did not deliver within 2.5 s")
                   for r in results[1:]), \
            results[1:]


@pytest.mark.parametrize("url", ["http://127.0.0.2:9/a\x7fb.png",
                                 "http://127.0.0.2:9/" + "a" * 70_000],
                         ids=["control-character", "too-long"])
async def test_a_url_httpx_cannot_send_is_a_400(url):
    """httpx refuses these when building the request (``httpx.InvalidURL``, which is not an
    ``httpx.HTTPError``): the client's mistake, a 400 naming the field, not a 500."""
    status, message = await outcome(url, policy(2.0))
    assert status == 400 and message.startswith("image URL is malformed"), message


async def test_a_malformed_redirect_from_the_peer_is_a_400(peer):
    """A peer's ``Location`` that urllib cannot join (``ValueError``) is the request's 400,
    not a 500."""
    status, message = await outcome(f"{peer}/redirect-malformed", policy(2.0))
    assert (status, message) == (400, "image URL redirected to a malformed URL")
