"""The catalogue: regions (with coordinates and an optional edge engine), the central
clusters in each, their models and endpoints; model names and aliases -> candidates.

Built once at start-up (and again on config reload) from the ``RoutingConfig`` and the
gateway's cluster list, validated as it is built (``TableError`` names the problem).
Immutable afterwards; live state lives in ``routing.health.HealthState``.

With no ``regions`` configured the table has one implicit region (named after
``default_region``, else ``"local"``) holding every cluster and the edge engine if
there is one: the single-region default needs no routing config at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .config import AUTO, EDGE, RoutingConfig
from .errors import TableError, UnknownModel
from .geo import TrustedProxies, haversine_km
from .types import ClusterSpec, Location

__all__ = ["Cluster", "ModelRoute", "Region", "RoutingTable"]

IMPLICIT_REGION = "local"


@dataclass(frozen=True, slots=True)
class Region:
    name: str
    latitude: float | None
    longitude: float | None
    edge: bool
    clusters: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Cluster:
    name: str
    region: str
    models: tuple[str, ...]
    endpoints: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """What a requested model name means. ``kind``: ``"auto"``, ``"edge"`` or ``"central"``."""

    kind: str
    model: str  # the model name to send (for auto: the central model it escalates to)


class RoutingTable:
    """Regions, clusters and models; see the module docstring."""

    __slots__ = (
        "config",
        "regions",
        "clusters",
        "edge_model",
        "local_region",
        "default_region",
        "trusted_proxies",
        "central_model",
        "endpoint_choice",
        "_by_model",
        "_routes",
        "_coords",
        "_distance_memo",
    )

    def __init__(
        self,
        config: RoutingConfig,
        regions: dict[str, Region],
        clusters: dict[str, Cluster],
        edge_model: str | None,
        local_region: str,
        default_region: str,
    ) -> None:
        self.config = config
        self.regions = regions
        self.clusters = clusters
        self.local_region = local_region
        self.default_region = default_region
        self.edge_model = edge_model if regions[local_region].edge else None
        self.trusted_proxies = TrustedProxies(config.trusted_proxies)
        by_model: dict[str, list[Cluster]] = {}
        for c in clusters.values():
            for m in c.models:
                by_model.setdefault(m, []).append(c)
        self._by_model = {m: tuple(cs) for m, cs in by_model.items()}
        # with one endpoint or none there is nothing to choose between: a prompt's prefix
        # blocks (what each endpoint probably caches) would be hashed for nothing
        self.endpoint_choice = sum(len(c.endpoints) for c in clusters.values()) > 1
        self._coords = [
            (r.name, r.latitude, r.longitude)
            for r in regions.values()
            if r.latitude is not None and r.longitude is not None
        ]
        self._distance_memo: dict[tuple[float, float], dict[str, float]] = {}
        central = config.policy.central_model
        if central is None:
            local = [clusters[c] for c in regions[local_region].clusters]
            first = (local or list(clusters.values()) or [None])[0]
            central = first.models[0] if first is not None and first.models else None
        elif central not in self._by_model:
            raise TableError(f"policy.central_model {central!r} is not served by any cluster")
        self.central_model = central
        self._routes: dict[str, ModelRoute] = {}
        for name, target in config.aliases.items():
            self._routes[name] = self._resolve_alias(name, target)

    def _resolve_alias(self, name: str, target: str) -> ModelRoute:
        if target == AUTO:
            return ModelRoute(AUTO, self.central_model or (self.edge_model or ""))
        if target == EDGE or (target == self.edge_model and target is not None):
            if self.edge_model is None:
                raise TableError(f"alias {name!r} -> edge, but this region has no edge engine")
            return ModelRoute(EDGE, self.edge_model)
        if target not in self._by_model:
            raise TableError(f"alias {name!r} -> {target!r}, which no cluster serves")
        return ModelRoute("central", target)

    @classmethod
    def build(
        cls,
        config: RoutingConfig,
        clusters: Sequence[ClusterSpec] = (),
        edge_model: str | None = None,
    ) -> "RoutingTable":
        """Validate ``config`` against the gateway's ``clusters`` and build the table.

        ``edge_model``: the model name the in-process edge engine serves (``None``: no
        engine in this process).
        """
        specs: dict[str, ClusterSpec] = {}
        for spec in clusters:
            if spec.name in specs:
                raise TableError(f"duplicate cluster name {spec.name!r}")
            if not spec.endpoints:
                raise TableError(f"cluster {spec.name!r} has no endpoints")
            specs[spec.name] = spec
        if config.regions:
            region_cfgs = list(config.regions)
            regions = {
                r.name: Region(r.name, r.lat, r.lon, r.edge, tuple(r.clusters)) for r in region_cfgs
            }
        else:
            name = config.default_region or config.local_region or IMPLICIT_REGION
            regions = {name: Region(name, None, None, edge_model is not None, tuple(specs))}
        owner: dict[str, str] = {}
        for r in regions.values():
            for c in r.clusters:
                if c not in specs:
                    raise TableError(f"region {r.name!r} lists unknown cluster {c!r}")
                if c in owner:
                    raise TableError(f"cluster {c!r} is in regions {owner[c]!r} and {r.name!r}")
                owner[c] = r.name
        orphans = [c for c in specs if c not in owner]
        if orphans:
            raise TableError(f"clusters {orphans} are not listed in any region")
        names = list(regions)
        default_region = config.default_region if config.default_region in regions else names[0]
        local_region = config.local_region if config.local_region in regions else default_region
        built = {
            n: Cluster(n, owner[n], tuple(s.models), tuple(s.endpoints)) for n, s in specs.items()
        }
        return cls(config, regions, built, edge_model, local_region, default_region)

    # -- queries ------------------------------------------------------------------

    @property
    def has_edge(self) -> bool:
        return self.edge_model is not None

    def endpoint_ids(self) -> list[str]:
        """Every endpoint id (URL), for ``HealthState(endpoints=...)``."""
        return [e for c in self.clusters.values() for e in c.endpoints]

    def clusters_for(self, model: str) -> tuple[Cluster, ...]:
        return self._by_model.get(model, ())

    def models(self) -> list[str]:
        """Every model name a client may ask for (aliases, edge model, central models)."""
        names = dict.fromkeys(self._routes)
        if self.edge_model is not None:
            names[self.edge_model] = None
        names.update(dict.fromkeys(self._by_model))
        return list(names)

    def resolve_model(self, name: str) -> ModelRoute:
        """Requested model name -> what it means; raises ``UnknownModel``."""
        route = self._routes.get(name)
        if route is not None:
            return route
        if name == self.edge_model:
            return ModelRoute(EDGE, name)
        if name in self._by_model:
            return ModelRoute("central", name)
        raise UnknownModel(name)

    def distance_km(self, location: Location | None, region: str) -> float | None:
        r = self.regions[region]
        if location is None or location.latitude is None or location.longitude is None:
            return None
        if r.latitude is None or r.longitude is None:
            return None
        return haversine_km(location.latitude, location.longitude, r.latitude, r.longitude)

    def distances_km(self, location: Location | None) -> dict[str, float]:
        """Great-circle distance from ``location`` to every region with coordinates
        (empty when the location is unknown). Memoised per coordinate pair: clients
        come from a limited set of GeoIP city coordinates."""
        if location is None or location.latitude is None or location.longitude is None:
            return {}
        point = (location.latitude, location.longitude)
        memo = self._distance_memo.get(point)
        if memo is None:
            if len(self._distance_memo) >= 16384:
                self._distance_memo.clear()
            memo = {n: haversine_km(point[0], point[1], la, lo) for n, la, lo in self._coords}  # type: ignore[arg-type]
            self._distance_memo[point] = memo
        return memo

    def home_region(self, location: Location | None) -> str:
        """The region nearest to ``location``; the default region when unknown."""
        distances = self.distances_km(location)
        if not distances:
            return self.default_region
        return min(distances, key=distances.__getitem__)

    def __repr__(self) -> str:
        return (
            f"<RoutingTable regions={list(self.regions)} clusters={list(self.clusters)} "
            f"edge={self.edge_model!r} local={self.local_region!r}>"
        )
