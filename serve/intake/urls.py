"""Fetching ``http(s)`` image URLs without SSRF: off by default, allowlisted, address-checked.

Rules (each hop of a redirect chain is checked again):

1. Scheme ``http`` or ``https`` only; ``file:`` and everything else are always refused.
   URLs with user info (``http://user@host``) are refused.
2. The host must be on the allowlist: an entry ``example.com`` allows ``example.com`` and its
   subdomains; IP literals must be listed literally.
3. The host is resolved *once* and **every** address must be public: loopback, private
   (RFC 1918, ULA), link-local, multicast, unspecified, reserved, shared (CGNAT) and
   site-local addresses are refused, IPv4-mapped / 6to4 / Teredo IPv6 addresses are judged by
   the IPv4 address they carry. Numeric host spellings (``127.1``, ``0x7f000001``,
   ``2130706433``, ``0177.0.0.1``) resolve to the address they denote and are judged by it.
   Networks in ``allowed_networks`` (CIDR) are exempt (e.g. an internal object store).
4. The connection goes to the checked address (no second DNS lookup: no DNS rebinding); the
   ``Host`` header and TLS SNI carry the original name, and certificates are verified for it.
5. Redirects are not followed blindly: each ``Location`` goes through rules 1-4, at most
   ``max_redirects`` times.
6. The body is streamed with a byte cap (``max_bytes``), connect/read timeouts and an overall
   deadline (``total_timeout_s``).
7. Whatever the URL or the peer does (a malformed URL or ``Location``, a refused, reset, hung
   or dripping connection, a body over the cap) ends that one request with a 4xx; nothing a
   fetch does is shared with another request's fetch but the TLS context (:class:`UrlPolicy`),
   which is read-only.

Sources: OWASP SSRF Prevention Cheat Sheet (allowlists, resolved-address checks, redirect
handling); Python ``ipaddress`` for the address classes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx

from serve.intake.errors import IntakeError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
#: RFC 6598 shared address space (carrier-grade NAT), not flagged private by ``ipaddress``.
_SHARED = ipaddress.ip_network("100.64.0.0/10")


@dataclass(frozen=True)
class UrlPolicy:
    """What image URL fetching may do.

    Attributes:
        enabled: fetch ``http(s)`` URLs at all (off by default).
        allowlist: allowed host names / IP literals (lower case).
        allowed_networks: networks exempt from the public-address rule.
        max_bytes: largest body, bytes.
        connect_timeout_s / read_timeout_s: socket timeouts, seconds.
        total_timeout_s: deadline of the whole fetch (redirects and body included), seconds.
        max_redirects: redirect hops, each re-checked.
        tls: the TLS client context every ``https`` fetch verifies with (httpx's default:
            certifi's CA bundle, host names checked), built once with the policy and shared
            by all fetches (an ``ssl.SSLContext`` is safe to share). Building one parses the
            whole CA bundle on the event loop: built per fetch, a burst of URL requests
            stalled every request of the process, long enough for a valid URL among them to
            miss its deadline.
    """

    enabled: bool = False
    allowlist: tuple[str, ...] = ()
    allowed_networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    max_bytes: int = 20 * 2**20
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 10.0
    total_timeout_s: float = 10.0
    max_redirects: int = 3
    tls: ssl.SSLContext = field(default_factory=lambda: httpx.create_ssl_context(
        trust_env=False), compare=False, repr=False)


def embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address carried by an IPv4-mapped, 6to4 or Teredo IPv6 address, if any."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped:
            return ip.ipv4_mapped
        if ip.sixtofour:
            return ip.sixtofour
        if ip.teredo:
            return ip.teredo[1]
    return None


def is_public(ip: IPAddress) -> bool:
    """False for every non-public address class listed in the module docstring."""
    inner = embedded_ipv4(ip)
    if inner is not None and not is_public(inner):
        return False
    if ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_multicast \
            or ip.is_unspecified or ip.is_reserved:
        return False
    if isinstance(ip, ipaddress.IPv4Address) and ip in _SHARED:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local:
        return False
    return True


def address_allowed(ip: IPAddress, policy: UrlPolicy) -> bool:
    """Public, or inside one of ``policy.allowed_networks``."""
    return any(ip in net for net in policy.allowed_networks) or is_public(ip)


def host_allowed(host: str, policy: UrlPolicy) -> bool:
    """``host`` equals an allowlist entry or is a subdomain of one (case-insensitive)."""
    host = host.lower().rstrip(".")
    return any(host == entry or host.endswith("." + entry) for entry in policy.allowlist)


def check_url(url: str, policy: UrlPolicy, param: str) -> tuple[str, str, int]:
    """Rules 1-2 on one URL. Returns ``(scheme, host, port)``.

    Raises:
        IntakeError: 400 naming ``param``.
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise IntakeError(400, "image URL is malformed", param) from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise IntakeError(400, f"image URL scheme {scheme or '(none)'!r} is not accepted; send "
                          "the image as a data: URL", param)
    if not policy.enabled:
        raise IntakeError(400, "image URLs are disabled on this server; send the image as a "
                          "data:image/...;base64 URL", param)
    if parts.username is not None or parts.password is not None:
        raise IntakeError(400, "image URLs with user info are not accepted", param)
    host = (parts.hostname or "").lower()
    if not host or not host_allowed(host, policy):
        raise IntakeError(400, f"image URL host {host!r} is not on the allowlist", param)
    return scheme, host, port or (443 if scheme == "https" else 80)


async def resolve_checked(host: str, port: int, policy: UrlPolicy, param: str) -> IPAddress:
    """Rule 3: resolve ``host`` and return its first address if every address is allowed."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise IntakeError(400, f"image URL host {host!r} does not resolve", param) from None
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    if not addresses or not all(address_allowed(ip, policy) for ip in addresses):
        raise IntakeError(400, f"image URL host {host!r} resolves to a non-public address",
                          param)
    return addresses[0]


def _pinned(url: str, ip: IPAddress, port: int) -> str:
    parts = urlsplit(url)
    netloc = f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
    return urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))


async def fetch_image_url(url: str, policy: UrlPolicy, param: str) -> bytes:
    """Rules 1-7: the body of an allowed image URL, within ``policy.total_timeout_s`` overall
    (a server that answers and then drips one byte at a time cannot hold the request).

    Raises:
        IntakeError: 400 refused, malformed, unreachable or too slow URL, 413 body over
            ``max_bytes``.
    """
    try:
        async with asyncio.timeout(policy.total_timeout_s):
            return await _fetch(url, policy, param)
    except TimeoutError:
        raise IntakeError(400, f"image URL did not deliver within {policy.total_timeout_s:g} s",
                          param) from None


async def _fetch(url: str, policy: UrlPolicy, param: str) -> bytes:
    timeout = httpx.Timeout(policy.read_timeout_s, connect=policy.connect_timeout_s)
    async with httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False,
                                 verify=policy.tls) as client:
        for _ in range(policy.max_redirects + 1):
            scheme, host, port = check_url(url, policy, param)
            ip = await resolve_checked(host, port, policy, param)
            try:
                request = client.build_request(
                    "GET", _pinned(url, ip, port),
                    headers={"Host": host if port in (80, 443) else f"{host}:{port}"},
                    extensions={"sni_hostname": host} if scheme == "https" else {})
            except httpx.InvalidURL as exc:  # not an httpx.HTTPError: a control character
                # or an over-long URL, the client's or a peer's Location
                reason = str(exc).split(",")[0]
                raise IntakeError(400, f"image URL is malformed ({reason})", param) from None
            try:
                response = await client.send(request, stream=True)
            except httpx.HTTPError as exc:
                raise IntakeError(400, f"could not fetch image URL ({type(exc).__name__})",
                                  param) from None
            try:
                if response.is_redirect:
                    try:
                        url = urljoin(url, response.headers.get("location", ""))
                    except ValueError:  # a Location urllib cannot parse (``http://u[s@h/``)
                        raise IntakeError(400, "image URL redirected to a malformed URL",
                                          param) from None
                    continue
                if response.status_code != 200:
                    raise IntakeError(400, f"image URL answered HTTP {response.status_code}",
                                      param)
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body.extend(chunk)
                    if len(body) > policy.max_bytes:
                        raise IntakeError(413, f"image at URL exceeds {policy.max_bytes} bytes",
                                          param, code="image_too_large")
                return bytes(body)
            except httpx.HTTPError as exc:
                raise IntakeError(400, f"could not fetch image URL ({type(exc).__name__})",
                                  param) from None
            finally:
                await response.aclose()
    raise IntakeError(400, f"image URL redirected more than {policy.max_redirects} times",
                      param)
