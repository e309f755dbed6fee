"""rollout-swarm peer layer: hivemind DHT, signed adverts, libp2p RPC, checkpoint broadcast.

Knows nothing about GRPO. docs/swarm.md describes the DHT key schema and the broadcast design.

Modules:

* :mod:`swarm.errors`        -- :class:`SwarmError` tree (start-up, DHT, transport, broadcast)
* :mod:`swarm.dht`           -- :class:`SwarmPeer` (DHT process + libp2p handle) and its config
* :mod:`swarm.keys`          -- the DHT key schema and chunk bitmaps
* :mod:`swarm.records`       -- signed DHT records: checks, DHT record validator, record types
* :mod:`swarm.adverts`       -- :class:`AdvertAnnouncer`, :func:`list_adverts`
* :mod:`swarm.transport`     -- request/response RPC over libp2p streams (:class:`P2PTransport`)
* :mod:`swarm.memtransport`  -- in-memory transport for unit tests
* :mod:`swarm.ratelimit`     -- :class:`TokenBucket` upload cap
* :mod:`swarm.bulkwindow`    -- :class:`BulkWindow`: bulk answers paced so control goes first
* :mod:`swarm.chunks`        -- :class:`ChunkStore`: verified chunks per version on disk
* :mod:`swarm.holders`       -- who holds which chunks (DHT bitmaps) and their announcer
* :mod:`swarm.scoring`       -- per-peer speed/reliability scores
* :mod:`swarm.fetcher`       -- one version's download: rarest first, best peer, seed last
* :mod:`swarm.wire`          -- swarm-local RPC messages (``ChunkAnyRequest``)
* :mod:`swarm.broadcast`     -- :class:`ChunkServer`, :class:`Downloader`, :class:`BroadcastNode`
* :mod:`swarm.deltasync`     -- :class:`VersionSync`: a version by delta, chain or in full
* :mod:`swarm.publication`   -- :class:`VersionBuilder`: a version to publish, keyframe or delta
* :mod:`swarm.peerproc`      -- a broadcast peer as a child process (tests, benchmark)
* :mod:`swarm.testing`       -- helpers for tests (loopback peers, sample adverts)
* :mod:`swarm.checkpoint_io` -- torch state_dict <-> safetensors file bytes
* :mod:`swarm.tasks`         -- bounded cancel-and-wait for owned background tasks
* :mod:`swarm.display`       -- human-readable figures: short unique fingerprints, units, hardware
                               (the status pages' and the shell's)
* :mod:`swarm.signals`       -- signal plumbing and fast exit shared by the processes' entry points
* :mod:`swarm.reachability`  -- measured reachability: can other peers dial this one
* :mod:`swarm.configfile`    -- reading any process's TOML config file, with one-line errors
* :mod:`swarm.files`         -- atomic writes of the small documents other processes poll for
* :mod:`swarm.faults`        -- fault-injection points for the reliability suite (inert by default)
* :mod:`swarm.netns`         -- network-namespace topologies (links, shaping, NAT) for tests, bench
* :mod:`swarm.delayline`     -- a userspace delay line on NFQUEUE where ``netem`` is missing
* :mod:`swarm.web`           -- the browser pages (coordinator dashboard, node page) and their
                                read-only HTTP server; uPlot vendored
* :mod:`swarm.shell`         -- the user-facing shell apart from the peer layer: the ``swarm``
                                command line, ``swarm demo``, ``swarm inspect``, the held-out
                                evaluation's assembly, the configuration reference. It drives
                                the roles; the peer layer never imports a role
                                (``tests/unit/test_layering.py``)

Nothing is imported here, so ``swarm --help`` stays fast (hivemind pulls in torch).
"""
