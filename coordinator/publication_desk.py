"""Version publication: verify, one read, a pure decision, one write.

:class:`PublicationDesk` records the trainer's signed manifests (``rswarm/publish``)::

    manifest envelope ─► verify_manifest (the pinned publisher key, the injected time)
                      ─► ONE transaction: read the newest version and a delta's base manifest
                         ─► publication_refusal (pure: newer than the newest, a delta's base
                            published here with the same root hash) ─► put_version
                      ─► lease lag, learner figures, the version gauge

:func:`publication_refusal` is a function of the manifest and what was read:
``tests/unit/test_registration.py`` tests it without SQLite.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge

from coordinator.activation import LearnerFigures
from coordinator.errors import Rejection
from coordinator.store import Store
from coordinator.throughput import LeaseLag
from protocol.codec import decode, encode
from protocol.errors import ReasonCode
from protocol.manifest import verify_manifest
from protocol.messages import Manifest, SignedEnvelope
from swarm.faults import fault_point

__all__ = ["PublicationDesk", "publication_refusal"]

log = logging.getLogger(__name__)


def publication_refusal(
    manifest: Manifest, latest: int | None, base: Manifest | None
) -> Rejection | None:
    """Why ``manifest`` cannot be the newest version (None: it can). ``latest``: the newest
    version published here; ``base``: the manifest published here under a delta's base version
    (None: none, or ``manifest`` is a keyframe). A delta must name its base by its exact root
    hash: the swarm could not apply it otherwise (the trainer then publishes a keyframe)."""
    if latest is not None and manifest.version <= latest:
        return Rejection(
            ReasonCode.VERSION_NOT_NEWER, f"version {manifest.version} is not newer than {latest}"
        )
    delta = manifest.delta
    if delta is not None and (base is None or base.root_hash != delta.base_root_hash):
        why = "was never published here" if base is None else "was published with other bytes"
        return Rejection(
            ReasonCode.DELTA_BASE_MISSING,
            f"v{manifest.version} is a delta against v{delta.base_version}, which {why};"
            " publish a keyframe",
        )
    return None


class PublicationDesk:
    """Records published versions (module docstring). ``publisher_key``: the trainer's key
    (None: every publication is refused); ``lease_lag`` and ``learner`` are told of each
    version; the ``swarm_policy_version`` gauge goes into ``registry``."""

    def __init__(
        self,
        *,
        store: Store,
        clock: Callable[[], float],
        publisher_key: bytes | None,
        lease_lag: LeaseLag,
        learner: LearnerFigures,
        registry: CollectorRegistry,
    ) -> None:
        self.store = store
        self.clock = clock
        self.publisher_key = publisher_key
        self.lease_lag = lease_lag
        self.learner = learner
        self._g_version = Gauge(
            "swarm_policy_version", "Latest published version", registry=registry
        )

    def publish(self, manifest_env: SignedEnvelope) -> Manifest:
        """Record a signed manifest (verified against ``publisher_key``) as the newest version."""
        if self.publisher_key is None:
            raise Rejection(ReasonCode.INTERNAL, "coordinator has no publisher key configured")
        manifest = verify_manifest(manifest_env, self.publisher_key, self.clock())
        store = self.store
        with store.transaction():
            latest = store.latest_version()
            base = None
            if manifest.delta is not None:
                raw = store.get_version(manifest.delta.base_version)
                if raw is not None:
                    base = decode(decode(raw, SignedEnvelope).payload, Manifest)
            refusal = publication_refusal(manifest, latest, base)
            if refusal is not None:
                raise refusal
            store.put_version(manifest.version, encode(manifest_env), self.clock())
        fault_point("publish.after_commit")
        self.lease_lag.published(manifest.version, self.clock())
        self.learner.published(manifest.version)
        self._g_version.set(manifest.version)
        log.info("published policy version %d", manifest.version)
        return manifest
