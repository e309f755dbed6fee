"""The learner: GRPO with staleness-aware importance weighting (DESIGN.md §8), torch.distributed.

Modules:

- :mod:`trainer.config` — :class:`~trainer.config.TrainerConfig` (pydantic, TOML, no torch import).
- :mod:`trainer.batch` — :class:`~trainer.batch.Rollout`, the record the trainer consumes, and
  :func:`~trainer.batch.build_batch` (padded tensors, completion mask up to and including EOS).
- :mod:`trainer.loss` — pure, shape-annotated math: group advantages, staleness admission,
  behaviour weights (truncate / mask / off, token / sequence level, λ^Δ), clipped surrogate,
  entropy bonus, mismatch-KL and ESS statistics.
- :mod:`trainer.recipe` — :class:`~trainer.recipe.Trainer`: ``setup``, ``run`` (the loop over
  a :class:`~trainer.sources.RolloutSource`), batches from the feed; its constructor composes
  the three collaborators below, once.
- :mod:`trainer.build` — :func:`~trainer.build.build_parts`: the model (LoRA, the engine's
  wrapping), optimizer, token ids, metrics writer and held-out evaluation that ``setup`` hands
  the Trainer.
- :mod:`trainer.step` — :class:`~trainer.step.LearnerStep` (built by the Trainer, receives
  what it uses; the run's idle clock comes with each call): ``train_step`` and its passes
  (π_prox, behaviour weights, updates, step KL, the record).
- :mod:`trainer.resume` — :class:`~trainer.resume.CheckpointStore` (built by the Trainer):
  ``save_checkpoint`` / ``load_checkpoint`` / ``latest_checkpoint`` / ``resume``.
- :mod:`trainer.publishing` — :class:`~trainer.publishing.Publications` (built by the
  Trainer): when versions go out, renumbering past the swarm's newest, ``published.json``.
- :mod:`trainer.progress` — the counters the Trainer hands its parts: steps and versions,
  rollouts pending (the resumable cursor), T_train.
- :mod:`trainer.sources` — the :class:`~trainer.sources.RolloutSource` and
  :class:`~trainer.sources.Publisher` protocols, :class:`~trainer.sources.VersionNotNewer`;
  in-process :class:`~trainer.sources.InProcessSource` and
  :class:`~trainer.sources.MemoryPublisher`.
- :mod:`trainer.checkpoints` — the checkpoint directories under ``out_dir`` (complete ones,
  pruning) and ``published.json``.
- :mod:`trainer.metrics` — per-step JSONL, Prometheus gauges, staleness histogram, the learner's
  idle fraction and its causes (:class:`~trainer.metrics.IdleClock`).
- :mod:`trainer.pipeline` — the loop's plumbing off the critical path: the rollout feed that
  fetches while the learner trains, the background publication slot.
- :mod:`trainer.distributed` — the process group (torchrun or ``--nproc``; gloo on CPU, NCCL on
  GPU): rank 0 shares and scatters, keep-alives.
- :mod:`trainer.engine` — one process or FSDP2 (``fully_shard`` per decoder layer): gradient
  reduction, clipping, the gathered weights to publish, the memory levers.
- :mod:`trainer.microbatch` — token-budgeted micro-batches (gradient accumulation).
- :mod:`trainer.dcp_checkpoint` — sharded checkpoints (``torch.distributed.checkpoint``) and
  resharding.
- :mod:`trainer.launch` — ``swarm trainer run --nproc N``; the ranks other than 0.
- :mod:`trainer.swarm_client` — the coordinator client: ``CoordinatorSource`` (rollouts) and
  ``SwarmPublisher`` (versions).
- :mod:`trainer.evaluation` — the held-out evaluation in the trainer: v0 and every
  ``eval_every`` versions, on a replica in a worker thread (off the critical path).
- :mod:`trainer.network` — :func:`~trainer.network.run_trainer`: the network process (joins
  the swarm, sets the recipe up, trains until stopped; the stop grace) and its step report.
- :mod:`trainer.main` — ``swarm trainer run``: the CLI's checks, the ranks, the exit codes.

See docs/trainer.md for the objective, every knob and every metric.
"""
