"""Helpers for the routing tests: .mmdb fixture builder, a three-region config.

(A uniquely named module rather than conftest imports, so that it cannot clash with
other test folders' helpers.)"""

from __future__ import annotations

from mmdb_writer import MMDBWriter
from netaddr import IPSet

from routing import ClusterSpec, RegionConfig, RoutingConfig

FIXED_EPOCH = 1_700_000_000


class FixedTimeWriter(MMDBWriter):
    """mmdb-writer stamps time.time() into the metadata; pin it for identical files."""

    def _build_meta(self):
        meta = super()._build_meta()
        meta["build_epoch"] = FIXED_EPOCH
        return meta


def city(iso: str, name: str, lat: float, lon: float) -> dict:
    return {
        "city": {"names": {"en": name}},
        "country": {"iso_code": iso, "names": {"en": iso}},
        "location": {"latitude": lat, "longitude": lon},
    }


FRANKFURT = city("DE", "Frankfurt", 50.11, 8.68)
SINGAPORE = city("SG", "Singapore", 1.35, 103.82)
SAN_JOSE = city("US", "San Jose", 37.34, -121.89)
TOKYO = city("JP", "Tokyo", 35.68, 139.69)

# broad networks first, then narrower ones inside them (mmdb-writer overwrites)
CITY_ENTRIES = [
    ("192.0.2.0/24", SAN_JOSE),  # TEST-NET-1
    ("198.51.100.0/24", FRANKFURT),  # TEST-NET-2
    ("203.0.113.0/24", SINGAPORE),  # TEST-NET-3
    ("203.0.113.128/25", TOKYO),  # narrower, inside TEST-NET-3
    ("172.16.0.0/12", TOKYO),  # a private range mapped on purpose
    ("2001:db8::/32", FRANKFURT),  # IPv6 documentation
    ("2001:db8:5::/48", SINGAPORE),  # narrower, inside it
]


def build_city_db(path: str) -> str:
    # IPv4 lives under ::/96 (ipv4_compatible); v4-mapped ::ffff:a.b.c.d is NOT mapped
    # here on purpose: routing.geo must unwrap it itself.
    w = FixedTimeWriter(ip_version=6, ipv4_compatible=True, database_type="Test-City", languages=["en"], description="edgegw test city db")
    for net, record in CITY_ENTRIES:
        w.insert_network(IPSet([net]), record)
    w.to_db_file(path)
    return path


US_WEST = RegionConfig(name="us-west", lat=37.77, lon=-122.42, edge=True, clusters=["usw"])
EU_CENTRAL = RegionConfig(name="eu-central", lat=50.11, lon=8.68, edge=True, clusters=["euc"])
AP_SOUTHEAST = RegionConfig(name="ap-southeast", lat=1.35, lon=103.82, edge=True, clusters=["aps"])

CLUSTERS = (
    ClusterSpec("usw", ("llama-70b",), ("http://usw-1", "http://usw-2", "http://usw-3")),
    ClusterSpec("euc", ("llama-70b", "mixtral"), ("http://euc-1", "http://euc-2")),
    ClusterSpec("aps", ("llama-70b",), ("http://aps-1",)),
)
EDGE_MODEL = "smollm2-135m"


def make_config(**overrides) -> RoutingConfig:
    base = dict(
        trusted_proxies=["10.0.0.0/8", "fd00::/8"],
        default_region="us-west",
        local_region="us-west",
        regions=[US_WEST, EU_CENTRAL, AP_SOUTHEAST],
        aliases={"auto": "auto", "fast": "edge", "smart": "llama-70b"},
    )
    base.update(overrides)
    return RoutingConfig.model_validate(base)


