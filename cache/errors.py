"""The cache package's errors.

    CacheError
      └── FlightAborted   the leader of a coalesced request gave up (upstream error, broken
                          stream, cancelled, lost); a follower should go upstream itself.

Backend failures (Redis down or slow) are not raised at all: a backend maps them to a miss
or a skipped write and counts them. The gateway translates these errors at its seam.
"""


class CacheError(Exception):
    """Base class of the cache package's errors."""


class FlightAborted(CacheError):
    """The leader of a single-flight aborted: nothing was produced for the followers."""

    def __init__(self, reason: str = "aborted") -> None:
        super().__init__(reason)
        self.reason = reason
