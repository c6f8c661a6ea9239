"""Fixtures shared by the gateway's routing tests."""

from __future__ import annotations

import pytest
from mmdb_writer import MMDBWriter
from netaddr import IPSet


def _city(iso: str, name: str, lat: float, lon: float) -> dict:
    return {
        "city": {"names": {"en": name}},
        "country": {"iso_code": iso, "names": {"en": iso}},
        "location": {"latitude": lat, "longitude": lon},
    }


@pytest.fixture(scope="session")
def geo_db(tmp_path_factory) -> str:
    """A small City database: the documentation ranges placed on three continents
    (192.0.2.0/24 San Jose, 198.51.100.0/24 Frankfurt, 203.0.113.0/24 Singapore)."""
    path = str(tmp_path_factory.mktemp("geo") / "city.mmdb")
    w = MMDBWriter(ip_version=6, ipv4_compatible=True, database_type="Test-City", languages=["en"], description="t")
    w.insert_network(IPSet(["192.0.2.0/24"]), _city("US", "San Jose", 37.34, -121.89))
    w.insert_network(IPSet(["198.51.100.0/24"]), _city("DE", "Frankfurt", 50.11, 8.68))
    w.insert_network(IPSet(["203.0.113.0/24"]), _city("SG", "Singapore", 1.35, 103.82))
    w.to_db_file(path)
    return path
