"""The contributor node: turns a machine with a GPU (or CPU) into a rollout generator.

Modules:

* :mod:`node.config`      -- :class:`NodeConfig` (pydantic, TOML + CLI overrides; no torch import)
* :mod:`node.main`        -- ``swarm node run``: preflight, ``--dry-run``, signals, exit codes
* :mod:`node.worker`      -- :class:`NodeWorker`: composes the pieces below in ``start()`` (peer,
                             checkpoints, client, registration, presence, work loop) and stops them
* :mod:`node.work`        -- :class:`WorkLoop`: lease -> load version -> generate -> sign and
                             submit, with back-off; the lease in hand and what the node is doing
* :mod:`node.presence`    -- advert builder, registrar, prefetcher, DHT advert loop and
                             :class:`Presence` (heartbeats, status line, reachability tasks)
* :mod:`node.generation`  -- :class:`GenerationThread`: ``backend.generate`` on its own thread
* :mod:`node.rollouts`    -- pure lease -> generation requests -> wire samples -> submission helpers
                             (prompt seeds, local lease limits, sampling config, finish reasons)
* :mod:`node.status`      -- the capability advert (``make_advert``), ``NodeStats`` counters,
                             ``Backoff`` (exponential, with jitter)
* :mod:`node.statuspage`  -- the volunteer's page (``--status-port``): what the node does, its
                             lease, tokens/s, versions, verdicts
* :mod:`node.client`      -- typed async client of the coordinator RPCs (``protocol.rpc``)
* :mod:`node.checkpoints` -- policy versions: download, verify against the pinned key, load,
                             never roll back (highest accepted version persisted on disk)
* :mod:`node.byzantine`   -- misbehaving modes for ``swarm demo --byzantine`` (off by default)
* :mod:`node.backends`    -- :class:`InferenceBackend` (hf, vllm, fake) and ``make_backend``
* :mod:`node.probe`       -- hardware probe and cached throughput self-benchmark

The model, tokenizer, sampling rule and re-scoring shared with the coordinator and the trainer
live in :mod:`policy` (the sampling contract).

Nothing is imported here, so ``swarm --help`` stays fast.
"""
