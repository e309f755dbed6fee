"""``swarm simulate``: a discrete-event simulation of the swarm around the real coordinator core.

The coordinator's own code decides (lease issue, deadlines and fencing, expiry and re-queue,
reputation and bans, the capacity planner and cost-aware activation, the learner's staleness
admission); nodes, links, dissemination, churn, cheaters and the learner are simulated in virtual
time with SimPy. docs/simulation.md is the user-facing description.

- :mod:`coordinator.sim.scenario`   ``Scenario`` (pydantic, TOML, dotted overrides, sweeps)
- :mod:`coordinator.sim.catalogue`  the GPU catalogue (``gpus.toml``)
- :mod:`coordinator.sim.costs`      measured figures from docs/benchmarks.md charged as time
- :mod:`coordinator.sim.calibration` the coordinator's own costs (checked-in calibration file),
  charged to one simulated coordinator core
- :mod:`coordinator.sim.network`    WAN links and checkpoint dissemination
- :mod:`coordinator.sim.base`       the world interface, pool entries, counters, reference model
- :mod:`coordinator.sim.nodes`      ``SimNode``: one node's messages, disruptions, cheats
- :mod:`coordinator.sim.verifier`   the log-prob verifier against the nodes' reference model
- :mod:`coordinator.sim.learner`    the learner's fetch / admit / step / publish loop
- :mod:`coordinator.sim.world`      one run: SimPy environment, the core, the intake queue
- :mod:`coordinator.sim.results`    ``RunResult`` and the invariants checked after every run
- :mod:`coordinator.sim.runner`     pools, provisioning policies, sweeps
- :mod:`coordinator.sim.report`     docs/simulation.md: tables and plots
- :mod:`coordinator.sim.scaling`    coordinator CPU per operation vs node count, saturation point
- :mod:`coordinator.sim.cli`        the ``swarm simulate`` command
"""
