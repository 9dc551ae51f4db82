"""``python -m bench.layers``: the gateway's layers in front of a scripted vLLM-like peer."""

from __future__ import annotations

import re

import pytest

from bench import layers


async def test_the_gateway_streams_the_whole_answer_through_every_layer():
    peer = layers.scripted_chat(5)
    await layers.check_stream(peer, 5)
    gw = layers.gateway(peer)
    await layers.check_stream(gw, 5)  # 200, role chunk, 5 tokens' chunks, [DONE]
    sent = await layers.serve_one(gw, *layers.chat_request(5))
    headers = dict(sent[0]["headers"])
    assert headers[b"x-accel-buffering"] == b"no" and b"x-request-id" in headers
    with pytest.raises(RuntimeError, match="not a full stream"):
        await layers.check_stream(gw, 6)  # a stream that differs from the request's


async def test_summary_line():
    m = await layers.measure(tokens=4, requests=3, repeats=2)
    line = layers.summary_line(m, 4)
    assert re.fullmatch(r"layers us_per_request=-?\d+ us_per_token=-?\d+\.\d\d "
                        r"\(tokens=4, over a bare peer of \d+ us\)", line), line
    assert m["ours_us"] > 0 and m["peer_us"] > 0


def test_the_scripted_peer_streams_what_the_guard_passes_in_o1():
    """bench.layers times the path the server takes: vLLM 0.32's token chunk ends as the
    stream guard's O(1) test expects (``tests/engine/test_api.py`` checks the live server's);
    the role and finish chunks do not and take the general test."""
    from serve.streamguard import TOKEN_EVENT_ENDS, ordinary_chunk

    assert layers.TOKEN_CHUNK.endswith(TOKEN_EVENT_ENDS) and ordinary_chunk(layers.TOKEN_CHUNK)
    assert not layers.ROLE_CHUNK.endswith(TOKEN_EVENT_ENDS)
    assert not layers.FINISH_CHUNK.endswith(TOKEN_EVENT_ENDS)
