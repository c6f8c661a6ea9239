import filecmp

import pytest

from routing import GeoLocator, TrustedProxies, client_address, haversine_km, locate_client
from routing.geo import embedded_db_path

from routing_fixtures import build_city_db

TRUSTED = TrustedProxies(["10.0.0.0/8", "192.168.0.0/16", "fd00::/8"])


@pytest.mark.parametrize(
    "peer, headers, expected",
    [
        pytest.param("203.0.113.9", {}, "203.0.113.9", id="no-header"),
        pytest.param("203.0.113.9", {"X-Forwarded-For": "198.51.100.1"}, "203.0.113.9", id="spoofed-xff-untrusted-peer"),
        pytest.param("203.0.113.9", {"Forwarded": "for=198.51.100.1"}, "203.0.113.9", id="spoofed-forwarded-untrusted-peer"),
        pytest.param("10.0.0.5", {"X-Forwarded-For": "198.51.100.1"}, "198.51.100.1", id="trusted-xff"),
        pytest.param("10.0.0.5", {"x-forwarded-for": "198.51.100.1"}, "198.51.100.1", id="lowercase-name"),
        pytest.param(
            "10.0.0.5",
            {"X-Forwarded-For": "6.6.6.6, 198.51.100.1, 192.168.1.1"},
            "198.51.100.1",
            id="walk-from-right-skipping-trusted-hops",
        ),
        pytest.param("10.0.0.5", {"X-Forwarded-For": "10.9.9.9, 192.168.1.1"}, "10.9.9.9", id="all-trusted-leftmost"),
        pytest.param("10.0.0.5", {"X-Forwarded-For": "198.51.100.1, garbage"}, "10.0.0.5", id="garbage-hop-stops-walk"),
        pytest.param("10.0.0.5", {"X-Forwarded-For": "198.51.100.1:4711"}, "198.51.100.1", id="xff-with-port"),
        pytest.param("10.0.0.5", {}, "10.0.0.5", id="trusted-peer-no-header"),
        pytest.param(
            "10.0.0.5",
            {"Forwarded": 'for=6.6.6.6, for="[2001:db8::7]:4711";proto=https, for=192.168.0.2'},
            "2001:db8::7",
            id="forwarded-ipv6-port",
        ),
        pytest.param(
            "10.0.0.5",
            {"Forwarded": "for=198.51.100.3", "X-Forwarded-For": "203.0.113.3"},
            "198.51.100.3",
            id="forwarded-wins-over-xff",
        ),
        pytest.param("10.0.0.5", {"Forwarded": "for=unknown"}, "10.0.0.5", id="forwarded-unknown"),
        pytest.param("fd00::1", {"X-Forwarded-For": "2001:db8::9"}, "2001:db8::9", id="ipv6-trusted-peer"),
        pytest.param("::ffff:10.0.0.5", {"X-Forwarded-For": "198.51.100.1"}, "198.51.100.1", id="v4-mapped-trusted-peer"),
        pytest.param("::ffff:203.0.113.9", {}, "203.0.113.9", id="v4-mapped-peer-unwrapped"),
        pytest.param(None, {"X-Forwarded-For": "198.51.100.1"}, None, id="no-peer"),
    ],
)
def test_client_address(peer, headers, expected):
    assert client_address(peer, headers, TRUSTED) == expected


def test_no_trusted_proxies_ignores_headers():
    assert client_address("10.0.0.5", {"X-Forwarded-For": "198.51.100.1"}, TrustedProxies()) == "10.0.0.5"


@pytest.mark.parametrize(
    "ip, country, city",
    [
        pytest.param("192.0.2.10", "US", "San Jose", id="test-net-1"),
        pytest.param("198.51.100.77", "DE", "Frankfurt", id="test-net-2"),
        pytest.param("203.0.113.5", "SG", "Singapore", id="broad"),
        pytest.param("203.0.113.200", "JP", "Tokyo", id="narrow-inside-broad"),
        pytest.param("172.31.255.1", "JP", "Tokyo", id="private-range-mapped"),
        pytest.param("2001:db8::1", "DE", "Frankfurt", id="ipv6"),
        pytest.param("2001:db8:5::42", "SG", "Singapore", id="ipv6-narrow"),
        pytest.param("::ffff:198.51.100.7", "DE", "Frankfurt", id="v4-mapped"),
    ],
)
def test_locate_fixture(city_db, ip, country, city):
    with GeoLocator.open(city_db) as geo:
        loc = geo.locate(ip)
    assert loc is not None
    assert (loc.country, loc.city) == (country, city)
    assert loc.latitude is not None and loc.longitude is not None


@pytest.mark.parametrize("ip", ["10.1.2.3", "8.8.8.8", "::1", "2001:db9::1", "not-an-ip", "", None])
def test_unknown_addresses_give_none(city_db, ip):
    with GeoLocator.open(city_db) as geo:
        assert geo.locate(ip) is None


def test_country_database_uses_country_lookup(country_db):
    with GeoLocator.open(country_db) as geo:
        loc = geo.locate("198.51.100.1")
    assert loc is not None and loc.country == "DE" and loc.latitude is None


def test_non_geo_database_rejected(asn_db):
    with pytest.raises(ValueError, match="neither City nor Country"):
        GeoLocator.open(asn_db)


def test_fixture_build_is_byte_identical(tmp_path):
    a = build_city_db(str(tmp_path / "a.mmdb"))
    b = build_city_db(str(tmp_path / "b.mmdb"))
    assert filecmp.cmp(a, b, shallow=False)


def test_embedded_dbip_database():
    assert embedded_db_path() is not None
    with GeoLocator.open(None) as geo:
        assert "City" in geo.database_type
        assert "DB-IP" in geo.attribution
        us = geo.locate("8.8.8.8")
        gb = geo.locate("81.2.69.142")
    assert us is not None and us.country == "US"
    assert gb is not None and gb.country == "GB"


def test_haversine_known_distances():
    assert haversine_km(51.5074, -0.1278, 48.8566, 2.3522) == pytest.approx(344, abs=3)  # London-Paris
    assert haversine_km(37.77, -122.42, 1.35, 103.82) == pytest.approx(13_590, rel=0.01)  # SF-Singapore
    assert haversine_km(10, 10, 10, 10) == 0


@pytest.mark.parametrize(
    "peer, headers, region",
    [
        pytest.param("10.0.0.1", {"X-Forwarded-For": "198.51.100.5"}, "eu-central", id="trusted-frankfurt"),
        pytest.param("203.0.113.5", {"X-Forwarded-For": "198.51.100.5"}, "ap-southeast", id="spoofed-ignored"),
        pytest.param("192.0.2.1", {}, "us-west", id="san-jose"),
        pytest.param("2001:db8:5::1", {}, "ap-southeast", id="ipv6-singapore"),
        pytest.param("100.64.0.1", {}, "us-west", id="unknown-default-region"),
        pytest.param("10.0.0.1", {}, "us-west", id="proxy-only-default-region"),
    ],
)
def test_locate_client_home_region(city_db, table, peer, headers, region):
    with GeoLocator.open(city_db) as geo:
        ip, loc = locate_client(table, geo, peer, headers)
    assert table.home_region(loc) == region
