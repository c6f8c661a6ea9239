"""observe/: where each millisecond went, and what the gateway says about it.

Owns: the metrics (``metrics.py``: counters, lock-free histograms, gauges read at scrape
time), the observer a finished request goes to (``observer.py``), the SLOs and their burn
rates (``slo.py``), the per-target bottleneck diagnosis (``diagnosis.py``), traces
(``tracing.py``, imported only when traces are on), the dashboard (``dashboard.py``), the
node's summed ``/metrics`` (``node_metrics.py``), the tenants' usage (``usage.py``) and the log filter that keeps credentials
out (``logs.py``).

Fed events (a finished ``RequestContext``, gauge readers), it imports no stage of the data
path. May import: ``gateway.core``, ``cache`` (its Redis circuit for the SLO counts).
"""

from gateway.observe.diagnosis import Diagnosis, Observation
from gateway.observe.logs import RedactSecrets, redact_logs
from gateway.observe.metrics import GaugeSample, LoopHistogram, Metrics, Series
from gateway.observe.observer import Observer
from gateway.observe.slo import SLOs

__all__ = [
    "Diagnosis",
    "GaugeSample",
    "LoopHistogram",
    "Metrics",
    "Observation",
    "Observer",
    "RedactSecrets",
    "SLOs",
    "Series",
    "redact_logs",
]
