"""The lightweight coordinator: prompts, leases, verification, durable state, capacity planning.

Modules (transport-independent core; the network service is built on :class:`core.Coordinator`):

- :mod:`coordinator.core`       ``Coordinator``: register / heartbeat / request_lease / submit /
                                release / fetch_rollouts / publish_version / status / tick
- :mod:`coordinator.submissions` ``SubmissionDesk``: the submission pipeline (load, check,
                                decide, record in one transaction), replayed submissions
- :mod:`coordinator.pipeline`   its pure steps over the one-read ``SubmissionContext``
- :mod:`coordinator.outcome`    its decision as a value (``Accepted`` / ``Refused``), pure
- :mod:`coordinator.submission_records` ``SubmissionRecords``: its reads and its one write
- :mod:`coordinator.lease_desk` ``LeaseDesk``: heartbeats and lease requests (one read, pure
                                rules, one transaction)
- :mod:`coordinator.feed`       ``RolloutFeed``: fetch_rollouts and the learner's reports
- :mod:`coordinator.activation` ``ActiveSet`` (the plan, the active set), ``LearnerFigures``
- :mod:`coordinator.liveness`   ``Liveness``: last_seen buffered and flushed in one commit
- :mod:`coordinator.admission`  ``Admission``: a known node with no ban in force;
                                ``ProbationBucket``: new identities at the budget's pace
- :mod:`coordinator.verify_budget` ``VerificationBudget``: verifiers' throughput V, the demand
                                D of the check rates, admission of new identities (issue 35)
- :mod:`coordinator.verifying`  ``VerifyingLeases``: leases whose submission waits for its
                                check do not expire
- :mod:`coordinator.slots`      ``PromptSlots``: a lease's prompts as issued
- :mod:`coordinator.config`     ``CoordinatorConfig`` (pydantic, TOML via ``load_config``)
- :mod:`coordinator.errors`     ``Rejection`` / ``IntakeRejection`` (wire reason codes),
                                ``ConfigError``, ``StoreError``
- :mod:`coordinator.tasks`      prompt sources and reward verifiers (``ReverseTask``, ``make_task``)
- :mod:`coordinator.datasets`   ``JsonlMathTask``: GSM8K-style JSONL + math-verify, hard timeout
- :mod:`coordinator.store`      SQLite (WAL, synchronous=FULL): nodes, leases, prompts, rollouts,
                                verdicts, strikes, bans, versions, meta
- :mod:`coordinator.schema`     the store's tables and migrations
- :mod:`coordinator.records`    row dataclasses of the store (``LeaseRecord``, ``RolloutRow``, ...)
- :mod:`coordinator.leases`     ``LeaseManager``: the lease state machine (injected clock)
- :mod:`coordinator.intake`     verification checks 3–7 of DESIGN.md §7 (``Intake``)
- :mod:`coordinator.logprobs`   ``LogprobVerifier`` protocol, ``InProcessLogprobVerifier``
- :mod:`coordinator.verifier_pool` re-scores as jobs on one queue for every verifier
                                (``VerifierPool``, the ``rswarm/vtake``/``vdone`` handlers)
- :mod:`coordinator.verifier_process` ``swarm coordinator verifier``: re-scores on another
                                GPU or machine
- :mod:`coordinator.trust`      adaptive check rates per node (new, suspect, trusted)
- :mod:`coordinator.audits`     reward audits: audit copies of prompts, the per-node sign test
- :mod:`coordinator.receipts`   the hash-chained, signed verdict log and its verification
- :mod:`coordinator.audit_cli`  ``swarm audit``: verify the log, trace one rollout
- :mod:`coordinator.reputation` strikes and bans with growing back-off
- :mod:`coordinator.capacity`   the capacity rule (admissible rate per node, predicted learner
                                idle) and cost-aware activation (pure; docs/capacity.md)
- :mod:`coordinator.throughput` ``ThroughputBook``: each node's generation rate, lease time,
                                round trips and version-load delay, measured lease by lease

The network process on top of it:

- :mod:`coordinator.service`    ``CoordinatorService``: composes the parts below around the core
                                on libp2p, in one ``start`` that reads top to bottom
- :mod:`coordinator.holding`    ``VersionHolder``: every published version fetched in full;
                                ``TBcastEstimate``; ``SpotCheckModels``: the spot-check models
- :mod:`coordinator.learner_link` ``LearnerLink``: the trainer's handlers (publish, fetch) and
                                the learner figures they carry
- :mod:`coordinator.node_rpc`   ``NodeHandlers``: the nodes' handlers (register, heartbeat,
                                lease, submit, release)
- :mod:`coordinator.status_board` ``StatusBoard``: the ``/status`` document served, its ticks,
                                ``rswarm/status``
- :mod:`coordinator.upkeep`     ``Upkeep``: the tick and the DHT records
- :mod:`coordinator.status`     the ``/status`` document, its wire form, the trainer gauges
- :mod:`coordinator.node_view`  per-node figures of ``/status`` (hardware, versions held, strikes)
- :mod:`coordinator.dissemination` ``HolderCensus``: which nodes hold each recent version (DHT)
- :mod:`coordinator.history`    ``StatusHistory``: the bounded time series the dashboard draws
- :mod:`coordinator.http`       ``StatusHttpServer``: the dashboard (``/``), ``/status``,
                                ``/api/history`` and ``/metrics``
- :mod:`coordinator.launch`     ``swarm coordinator launch``: flag checks, port test-binds,
                                state-dir lock, signal handling
- :mod:`coordinator.planning_cli` ``swarm coordinator plan``: the rule for a config and a pool
"""
