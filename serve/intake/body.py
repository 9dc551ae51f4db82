"""A request body's JSON, decoded and encoded again by the intake (``serve.intake.middleware``).

The decoder is strict where Python's ``json`` is lenient, and checks in C what
:func:`serve.intake.request.check_values` checks in Python; the encoder writes the body vLLM
reads. Both are msgspec's (a vLLM dependency): a text request's body is decoded and encoded
on the event loop, once per request, and the loop streams every answer.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from serve.intake.errors import IntakeError
from serve.intake.request import check_values


def decode_body(raw: bytes) -> Any:
    """A request body decoded, every string valid Unicode and every number finite (the rules
    of :func:`serve.intake.request.check_values`).

    msgspec's strict decoder refuses in C what ``check_values`` refuses (lone surrogates, the
    literals ``NaN`` and ``Infinity``, numbers beyond a double's range), so a clean body is
    decoded once and walked by no Python. A body it refuses is decoded again by Python's
    lenient ``json`` and walked, which names the field (or gives Python's own error); a body
    ``json`` accepts and the walk clears (UTF-16, which Python detects) is returned as such.

    Raises:
        IntakeError: 400: not JSON, nested too deeply, or the field of the first string or
            number ``check_values`` refuses.
    """
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        pass
    except RecursionError:
        raise IntakeError(400, "request body is nested too deeply") from None
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise IntakeError(400, f"request body is not valid JSON ({exc})") from None
    except RecursionError:
        raise IntakeError(400, "request body is nested too deeply") from None
    check_values(data)
    return data


def encode_body(body: Any) -> bytes:
    """``body`` (as :func:`decode_body` returned it, possibly edited) as compact UTF-8 JSON.

    Raises:
        TypeError: a value that is not JSON's (a bug of the edit, never the client's).
    """
    return msgspec.json.encode(body)
