"""Per-peer scores for choosing whom to download chunks from.

A peer's score is its measured throughput (EWMA of bytes/s, a prior for unknown peers) times a
reliability factor that falls with failures and collapses with bad chunks. Scores persist across
transfers (a peer that served garbage for version 7 starts low for version 8).

A peer that served a bad chunk or a bad manifest is :meth:`PeerScores.shunned`: the downloader
does not ask it again while this process runs (a low score alone would not keep it out: holders
are always asked before the seed). An honest peer verifies every chunk before serving it, so this
only costs a peer whose disk or memory corrupts data after verification. Seeds are exempt: they
are backed off, never dropped.

A peer that could not be dialled (behind NAT, gone) is :meth:`PeerScores.backed_off` for
``DIAL_BACKOFF_S`` seconds, doubling with each further failed dial up to ``DIAL_BACKOFF_MAX_S``;
a success clears it. So an unreachable holder costs one bounded dial, not a dial per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_BPS = 5e6
"""Assumed throughput of a peer never measured (bytes/s); high enough to try newcomers."""
BAD_CHUNK_PENALTY = 0.01
"""Each bad chunk multiplies the score by this (a wrong hash is a strong signal of malice)."""
DIAL_BACKOFF_S = 30.0
"""A peer whose dial failed is not asked again for this long (doubled per further failure)."""
DIAL_BACKOFF_MAX_S = 600.0


@dataclass
class PeerStats:
    """What we observed from one peer (counts since this process started)."""

    ewma_bps: float | None = None  # smoothed download speed from this peer, bytes/s
    successes: int = 0  # chunks received and verified
    failures: int = 0  # timeouts, broken streams, refusals other than "busy"
    bad_chunks: int = 0  # chunks that failed verification
    dial_failures: int = 0  # consecutive dials that failed (reset by a success)
    backoff_until: float = 0.0  # monotonic time before which the peer is not dialled again
    stalls: int = 0  # requests cancelled for progressing too slowly

    @property
    def reliability(self) -> float:
        ratio = (self.successes + 1) / (self.successes + self.failures + 1)
        return float(ratio * BAD_CHUNK_PENALTY ** min(self.bad_chunks, 8))

    @property
    def score(self) -> float:
        speed = PRIOR_BPS if self.ewma_bps is None else self.ewma_bps
        return speed * self.reliability


class PeerScores:
    """Scores of all peers seen; ``alpha`` is the EWMA weight of the newest speed sample."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self._stats: dict[str, PeerStats] = {}

    def stats(self, peer_id: str) -> PeerStats:
        return self._stats.setdefault(peer_id, PeerStats())

    def score(self, peer_id: str) -> float:
        return self.stats(peer_id).score

    def success(self, peer_id: str, nbytes: int, seconds: float) -> None:
        s = self.stats(peer_id)
        s.successes += 1
        s.dial_failures, s.backoff_until = 0, 0.0
        bps = nbytes / max(seconds, 1e-6)
        s.ewma_bps = bps if s.ewma_bps is None else (1 - self.alpha) * s.ewma_bps + self.alpha * bps

    def failure(self, peer_id: str) -> None:
        self.stats(peer_id).failures += 1

    def dial_failed(self, peer_id: str, now: float) -> float:
        """A connection to ``peer_id`` could not be opened; returns the back-off's end. Requests
        that were already in flight when the back-off began do not count again."""
        s = self.stats(peer_id)
        if s.backoff_until > now:
            return s.backoff_until
        s.failures += 1
        s.dial_failures += 1
        delay = min(DIAL_BACKOFF_MAX_S, DIAL_BACKOFF_S * 2 ** min(s.dial_failures - 1, 16))
        s.backoff_until = max(s.backoff_until, now + delay)
        return s.backoff_until

    def stalled(self, peer_id: str) -> None:
        """A request to ``peer_id`` progressed too slowly and was given up."""
        s = self.stats(peer_id)
        s.failures += 1
        s.stalls += 1

    def backed_off(self, peer_id: str, now: float) -> bool:
        """True while ``peer_id`` is in its dial back-off."""
        stats = self._stats.get(peer_id)
        return stats is not None and stats.backoff_until > now

    def bad_chunk(self, peer_id: str) -> None:
        """``peer_id`` served a chunk or manifest that failed verification."""
        self.stats(peer_id).bad_chunks += 1

    def shunned(self, peer_id: str) -> bool:
        """True once ``peer_id`` served bad data: not to be asked again (unless it is a seed)."""
        stats = self._stats.get(peer_id)
        return stats is not None and stats.bad_chunks > 0

    def snapshot(self) -> dict[str, dict[str, float]]:
        """``{peer id: {score, ewma_bps, successes, failures, bad_chunks, dial_failures,
        stalls}}`` for status output."""
        return {
            p: {
                "score": s.score,
                "ewma_bps": s.ewma_bps or 0.0,
                "successes": s.successes,
                "failures": s.failures,
                "bad_chunks": s.bad_chunks,
                "dial_failures": s.dial_failures,
                "stalls": s.stalls,
            }
            for p, s in self._stats.items()
        }
