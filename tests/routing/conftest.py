"""Fixtures for routing tests: small .mmdb files built with mmdb-writer, a table."""

from __future__ import annotations

import pytest
from routing_fixtures import CLUSTERS, EDGE_MODEL, FixedTimeWriter, build_city_db, make_config
from netaddr import IPSet

from routing import HealthState, RoutingConfig, RoutingTable


@pytest.fixture(scope="session")
def city_db(tmp_path_factory) -> str:
    return build_city_db(str(tmp_path_factory.mktemp("geo") / "city.mmdb"))


@pytest.fixture(scope="session")
def country_db(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("geo") / "country.mmdb")
    w = FixedTimeWriter(ip_version=6, ipv4_compatible=True, database_type="Test-Country", languages=["en"], description="c")
    w.insert_network(IPSet(["198.51.100.0/24"]), {"country": {"iso_code": "DE", "names": {"en": "Germany"}}})
    w.to_db_file(path)
    return path


@pytest.fixture(scope="session")
def asn_db(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("geo") / "asn.mmdb")
    w = FixedTimeWriter(ip_version=6, ipv4_compatible=True, database_type="Test-ASN", languages=["en"], description="a")
    w.insert_network(IPSet(["198.51.100.0/24"]), {"autonomous_system_number": 64496})
    w.to_db_file(path)
    return path


@pytest.fixture
def config() -> RoutingConfig:
    return make_config()


@pytest.fixture
def table(config) -> RoutingTable:
    return RoutingTable.build(config, CLUSTERS, EDGE_MODEL)


@pytest.fixture
def health(config, table) -> HealthState:
    return HealthState.from_config(config, table.endpoint_ids())
