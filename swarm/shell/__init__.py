"""The user-facing shell: the ``swarm`` command line and what it shows, apart from the peer layer.

The shell drives the roles (``coordinator``, ``node``, ``trainer``) and the peer layer
(:mod:`swarm`); nothing below it imports it (``tests/unit/test_layering.py``)::

    protocol  <-  swarm (peer layer)  <-  coordinator / node / trainer / policy  <-  swarm.shell

Modules:

* :mod:`swarm.shell.cli`              -- the ``swarm`` command line (typer); each command
                                         imports its role after the flags are parsed
* :mod:`swarm.shell.demo`             -- ``swarm demo``: a local swarm as separate processes
* :mod:`swarm.shell.demo_options`     -- the demo's flags, profiles and ``--trainer-set``
* :mod:`swarm.shell.demo_report`      -- the demo's live view, plot and summary
* :mod:`swarm.shell.inspect`          -- ``swarm inspect``: join the DHT as a client, show the swarm
* :mod:`swarm.shell.heldout`          -- the held-out evaluation put together for ``swarm trainer
                                         run`` (the task's split and verifier, the policy's
                                         rendering and protocol), handed to the trainer
* :mod:`swarm.shell.config_reference` -- docs/configuration.md from the three typed configs
                                         (``python -m swarm.shell.config_reference --check``)

Nothing is imported here, so ``swarm --help`` stays fast (hivemind pulls in torch).
"""
