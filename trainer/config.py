"""Typed trainer configuration (imports no torch: ``--help`` stays instant).

Loaded from TOML (flat keys, see ``trainer/trainer.example.toml``), overridable field by field;
unknown keys and cross-field contradictions fail at load with the field named.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: the default and largest ``stop_grace_s``: the trainer's stop bound (20 s, docs/operations.md
#: "Stopping"; the ``--nproc`` launcher's kill deadline) counts on at most this much
STOP_GRACE_S = 10.0


def nones(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with every string ``"none"`` (any case) as None: how a TOML file or a
    ``KEY=VALUE`` flag switches off a setting whose None means off (TOML has no null)."""
    return {k: None if isinstance(v, str) and v.lower() == "none" else v for k, v in data.items()}


class TrainerConfig(BaseModel):
    """GRPO learner settings. Symbols follow DESIGN.md §8–§9 (S, κ, ε, C, λ)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- model -----------------------------------------------------------------------------
    model_path: str | None = Field(
        None, description="Local HF model directory; None trains the embedded default model."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of the trainer's weights (the optimizer runs in this dtype)."
    )
    seed: int = Field(0, description="Seed of the initial weights and of minibatch order.")
    device: str = Field(
        "auto",
        description="Torch device of the weights: 'auto' = this rank's GPU if any, else 'cpu'.",
    )

    # --- LoRA (docs/trainer.md "LoRA or full fine-tuning"; policy/lora.py) -------------------
    lora_rank: int = Field(
        0,
        ge=0,
        le=4096,
        description="LoRA rank r: train low-rank adapters with peft over the frozen base model "
        "(model_path, or the embedded default's weights at seed 0; `seed` draws the adapters) "
        "and publish each version as an adapter (docs/protocol.md §8.6); 0: full-parameter "
        "training (full and delta versions).",
    )
    lora_alpha: float = Field(
        32.0,
        gt=0.0,
        description="LoRA alpha: the adapter's output is scaled by alpha / lora_rank (dropout 0).",
    )
    lora_target_modules: tuple[str, ...] = Field(
        ("all-linear",),
        min_length=1,
        description="Modules that get adapters: names or name suffixes of linear layers (e.g. "
        "q_proj, v_proj), or ['all-linear'] for every linear layer but the output head.",
    )

    # --- sampling contract (must equal the coordinator's leases) -----------------------------
    temperature: float | None = Field(
        None,
        gt=0.0,
        description="Sampling temperature of the leases: π_θ and π_prox are log-probs of the same "
        "processed distribution as μ. None: the coordinator's (read at start; 1.0 in process); "
        "a value that differs from the coordinator's is refused at start.",
    )
    top_p: float | None = Field(
        None, gt=0.0, le=1.0, description="Nucleus mass of the leases (None: the coordinator's)."
    )
    top_k: int | None = Field(
        None, ge=0, description="Top-k of the leases, 0 = off (None: the coordinator's)."
    )

    # --- batch -----------------------------------------------------------------------------
    batch_prompts: int = Field(32, ge=1, description="Groups (prompts) per learner step.")
    group_size: int = Field(8, ge=2, description="Samples per prompt, G (a group's size).")
    minibatches: int = Field(
        4,
        ge=1,
        description="Optimizer updates per step: the batch is split into this many minibatches of "
        "whole groups; from the second on, the PPO clip against π_prox is active.",
    )
    ppo_epochs: int = Field(1, ge=1, description="Passes over the batch per learner step.")
    filter_groups: bool = Field(
        True,
        description="Train on informative groups only (DAPO's dynamic sampling, verl's "
        "filter_groups): a complete group whose samples all got the same reward (advantage 0 "
        "for every sample) is left out of the batch, counted as dropped_uniform, and more groups "
        "are taken from the queue until batch_prompts informative ones are in. The learner then "
        "consumes more rollouts per step (reported to the coordinator as batch_rollouts). On by "
        "default: measured faster under staleness and steadier in the demo (docs/trainer.md, "
        "'How the defaults were chosen').",
    )
    filter_drop: Literal["uniform", "solved"] = Field(
        "uniform",
        description="With filter_groups, which groups are left out: 'uniform' every group whose "
        "samples all got one reward (DAPO); 'solved' only those whose samples all got the full "
        "reward 1, so a group stuck on one wrong answer is still trained on (advantage 0: the "
        "entropy bonus alone acts on it, the exploration a stuck prompt needs).",
    )
    filter_max_batches: int = Field(
        4,
        ge=1,
        description="With filter_groups: a step looks at no more than this many batches' worth of "
        "complete groups; when they hold fewer than batch_prompts informative groups, the step "
        "trains on those, filled with uniform groups up to `minibatches` groups (a solved task "
        "does not starve the learner).",
    )

    # --- memory (one process or several, see docs/trainer.md "Scale-out") -------------------
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="Token budget of one forward/backward pass: a rank's share of a minibatch "
        "is split into micro-batches of at most this many padded tokens (rows × padded length) "
        "whose gradients accumulate; None = the whole share in one pass.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in backward instead of keeping "
        "them (less memory, about one more forward of compute).",
    )
    autocast: Literal["off", "bf16"] = Field(
        "off",
        description="'bf16': forward and backward under torch.autocast(bfloat16) (for GPUs); "
        "weights, gradients and optimizer state stay in `dtype`, log-probs in fp32.",
    )

    # --- staleness -------------------------------------------------------------------------
    max_staleness: int = Field(
        4,
        ge=0,
        description="S: rollouts with Δ = version − rollout version > S are not trained on.",
    )
    publish_every: int | None = Field(
        None,
        ge=1,
        description="κ: steps between published versions; None means max(1, S − 1).",
    )
    weight_mode: Literal["truncate", "mask", "reject", "raw", "off"] = Field(
        "truncate",
        description="Behaviour weight w = π_prox/μ: 'truncate' min(w, C) (TIS); 'mask' w = 0 "
        "outside [C_low, C] (MIS, IcePop); 'reject' w = 1 inside the band, 0 outside (rejection "
        "sampling, Geo-RS); 'raw' w untruncated; 'off' w = 1 (no correction).",
    )
    weight_level: Literal["token", "sequence", "geometric"] = Field(
        "token",
        description="Unit of the weight: per token, per sequence (product of its token ratios) "
        "or the sequence's geometric mean ratio (Geo-RS).",
    )
    weight_cap: float = Field(2.0, gt=1.0, description="C: truncation cap / upper mask bound.")
    weight_cap_low: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="C_low: lower bound of the mask/reject band; None means 1/C (IcePop: 0.5).",
    )
    m2_threshold: float | None = Field(
        None,
        gt=0.0,
        description="τ_M2 (M2PO): drop the tokens with the largest (log π_prox/μ)² until their "
        "mean over the tokens left is ≤ τ_M2; None disables (M2PO uses 0.04).",
    )
    ess_lr_scaling: bool = Field(
        True,
        description="VCPO: scale each update's learning rate by sqrt(min(1, ESS/n)) of the "
        "minibatch's sequence-level ratios π_prox/μ (damps updates on degenerate weights; 1 on "
        "fresh rollouts). On by default: measured the steadiest under staleness "
        "(docs/trainer.md, 'How the defaults were chosen').",
    )
    staleness_decay: float = Field(
        1.0, gt=0.0, le=1.0, description="λ: weights are multiplied by λ^Δ (1.0 disables)."
    )

    # --- objective -------------------------------------------------------------------------
    clip_eps: float = Field(0.2, gt=0.0, lt=1.0, description="ε: lower PPO clip, ratio ≥ 1 − ε.")
    clip_eps_high: float | None = Field(
        None, gt=0.0, description="ε_high: upper PPO clip, ratio ≤ 1 + ε_high; None means ε."
    )
    std_normalize: bool = Field(True, description="Divide group-centred rewards by the group std.")
    adv_eps: float = Field(1e-4, gt=0.0, description="Added to the group std (TRL uses 1e-4).")
    entropy_coef: float = Field(0.1, ge=0.0, description="β_H: entropy bonus coefficient.")
    entropy_groups: Literal["all", "informative"] = Field(
        "all",
        description="Tokens the entropy bonus acts on: 'all' completion tokens, or only those of "
        "samples with a non-zero advantage ('informative': the tokens the policy term acts on, "
        "so a batch of solved groups gets no bonus either and the two terms keep their balance "
        "as the task gets solved).",
    )

    # --- stability monitors (trainer/monitors.py; thresholds from bench/staleness.py) --------
    warn_window: int = Field(
        5, ge=1, description="Steps averaged before a monitored figure is compared with its bound."
    )
    warn_ess_frac_below: float | None = Field(
        None, ge=0.0, le=1.0, description="Warn when ESS/n of the behaviour weights is below this."
    )
    warn_mismatch_kl_above: float | None = Field(
        None,
        ge=0.0,
        description="Warn when KL(μ‖π_prox) per token (over the tokens both support) is above "
        "this.",
    )
    warn_out_of_support_frac_above: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Warn when more completion tokens than this lie outside the top-k/top-p "
        "support of π_prox (or μ): weight 0, counted apart from the mismatch KL. bf16 "
        "publication puts ~1e-4 there; more means the nodes sample from other weights or "
        "settings.",
    )
    warn_clip_frac_above: float | None = Field(
        None, ge=0.0, le=1.0, description="Warn when the PPO clip binds on more tokens than this."
    )
    warn_mask_frac_above: float | None = Field(
        None, ge=0.0, le=1.0, description="Warn when more tokens than this get weight 0."
    )
    warn_grad_norm_above: float | None = Field(
        None, gt=0.0, description="Warn when the gradient norm (before clipping) is above this."
    )

    # --- optimizer -------------------------------------------------------------------------
    lr: float = Field(5e-4, gt=0.0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    adam_beta1: float = Field(
        0.9,
        ge=0.0,
        lt=1.0,
        description="AdamW β1 (decay of the gradient average, momentum). Rollouts S versions old "
        "already act as momentum (the update follows gradients of older policies); a lower β1 "
        "keeps the two from compounding.",
    )
    adam_beta2: float = Field(
        0.999,
        gt=0.0,
        lt=1.0,
        description="AdamW β2 (decay of the squared-gradient average); lower reacts faster to a "
        "gradient spike, so one outlier batch moves the weights less.",
    )
    grad_spike_factor: float | None = Field(
        None,
        gt=1.0,
        description="Skip an optimizer update whose gradient norm is more than this many times "
        "the median of the last 50 updates' (a single outlier batch); None disables.",
    )
    max_step_kl: float | None = Field(
        None,
        gt=0.0,
        description="Undo a learner step (weights and optimizer state) that moved the policy by "
        "more than this KL (nats per token, k3 estimate on the step's own tokens; "
        "trainer/rollback.py); costs one forward pass per step and a copy of the parameters and "
        "optimizer state. None: off (step_kl is then not measured).",
    )
    target_step_kl: float | None = Field(
        None,
        gt=0.0,
        description="KL-adaptive learning rate (rsl_rl's 'adaptive' schedule; trainer/"
        "adaptive_lr.py): after each learner step the learning rate is divided by "
        "adaptive_lr_change when step_kl (nats per token) was above 2x this and multiplied by "
        "it when below half, within [adaptive_lr_min, adaptive_lr_max] x lr; costs one forward "
        "pass per step. None: off (lr as configured).",
    )
    target_mismatch_kl: float | None = Field(
        None,
        gt=0.0,
        description="The same schedule driven by the step's mismatch KL(μ‖π_prox) per token "
        "(measured anyway: no forward pass) instead of step_kl: the rate shrinks only while the "
        "rollouts trained on are far from π_prox, so fresh rollouts (S = 0) train at lr. "
        "Excludes target_step_kl.",
    )
    adaptive_lr_change: float = Field(
        1.5, gt=1.0, description="Factor by which target_step_kl moves the learning rate."
    )
    adaptive_lr_min: float = Field(
        0.05,
        gt=0.0,
        le=1.0,
        description="Lowest learning rate with target_step_kl or target_mismatch_kl, as x lr.",
    )
    adaptive_lr_max: float = Field(
        1.0,
        ge=1.0,
        description="Highest learning rate with target_step_kl or target_mismatch_kl, as x lr "
        "(1: never above lr; 2 was faster and collapsed more in bench/staleness.py).",
    )
    max_grad_norm: float | None = Field(
        1.0, gt=0.0, description="Clip the global gradient norm to this; None disables."
    )

    # --- publishing ------------------------------------------------------------------------
    publish_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16",
        description="dtype of the published weights (the trainer keeps its own dtype for the "
        "optimizer): bf16 halves the bytes and leaves most weights bit-identical from one "
        "version to the next, so versions travel as small deltas.",
    )
    direct_port: int = Field(
        0,
        ge=-1,
        le=65535,
        description="TCP port for direct chunk connections, which carry checkpoint chunks off "
        "the libp2p daemon, for less CPU (docs/swarm.md, Direct connections); 0 = any "
        "free port, -1 = off (chunks only over libp2p).",
    )
    keyframe_every: int = Field(
        0,
        ge=0,
        description="Every K-th published version is a full keyframe (no delta); 1 turns deltas "
        "off; 0 publishes keyframes only when needed (first version, no base, layout change, "
        "delta not smaller than half the checkpoint).",
    )

    # --- held-out evaluation (trainer/evaluation.py; the protocol: policy/evaluation.py) -------
    eval_every: int | None = Field(
        None,
        ge=1,
        description="Score the held-out set of eval_task at the version the run starts from "
        "(0: the base model) and every this many versions after, in a worker thread on a copy "
        "of the weights (metrics.jsonl lines with record = eval, /status eval_*); None: off.",
    )
    eval_task: str | None = Field(
        None,
        description="Task whose held-out split is scored (the coordinator's task name: arith, "
        "arith-words:N, jsonl:PATH); needed with eval_every.",
    )
    eval_prompts: int = Field(100, ge=1, description="Held-out prompts scored (N).")
    eval_samples: int = Field(
        4,
        ge=0,
        description="pass@1 samples per held-out prompt at the leases' temperature/top-p/top-k "
        "(0: greedy accuracy only).",
    )
    eval_max_new_tokens: int | None = Field(
        None, ge=1, description="Token budget of a held-out completion; None: the leases'."
    )
    eval_system_prompt: str | None = Field(
        None,
        description="System message the held-out prompts are rendered with (the coordinator's "
        "prompt.system_prompt: set the same one).",
    )
    eval_threads: int = Field(
        1, ge=1, description="Torch threads of the held-out evaluation's worker thread."
    )

    # --- run -------------------------------------------------------------------------------
    out_dir: str = Field("runs/trainer", description="Checkpoints and metrics.jsonl go here.")
    checkpoint_every: int = Field(
        50, ge=1, description="Save a resumable checkpoint every this many steps."
    )
    keep_checkpoints: int = Field(2, ge=1, description="Resumable checkpoints kept on disk.")
    resume: bool = Field(True, description="Resume from the latest checkpoint in out_dir if any.")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many steps (None: run).")
    fetch_timeout_s: float = Field(
        30.0, gt=0.0, description="Seconds one rollout fetch may wait before it is retried/logged."
    )
    stop_grace_s: float = Field(
        STOP_GRACE_S,
        gt=0.0,
        le=STOP_GRACE_S,
        description="After SIGINT/SIGTERM, seconds the learner step, publication or model set-up "
        "in progress may take to finish; then it is abandoned (the last checkpoint stands). At "
        "most 10: the trainer's stop bound (20 s) counts on it.",
    )
    overlap: bool = Field(
        True,
        description="Keep the swarm's plumbing off the learner's critical path: train in a worker "
        "thread while the next rollouts are fetched and the last version is published in the "
        "background. False: fetch, train and publish one after the other (for comparison).",
    )
    prefetch_batches: int = Field(
        2,
        ge=1,
        description="With overlap: rollouts buffered ahead of the learner, in batches "
        "(batch_prompts × group_size each).",
    )
    idle_window_s: float = Field(
        60.0,
        gt=0.0,
        description="idle_frac and its breakdown are measured over this many recent seconds.",
    )
    trace_rollouts: bool = Field(
        False,
        description="Record each step's start and end (Unix time) and, per trained rollout, its "
        "seq, policy version and when the trainer fetched it (``trace`` in metrics.jsonl): the "
        "trainer's half of the per-rollout age breakdown (bench/_age.py, docs/capacity.md).",
    )

    @model_validator(mode="after")
    def _cross_field(self) -> TrainerConfig:
        limit = max(1, self.max_staleness - 1)  # same rule as the coordinator's config
        if self.publish_every is not None and self.publish_every > limit:
            raise ValueError(
                f"publish_every={self.publish_every} must be <= max(1, max_staleness − 1) = "
                f"{limit}: results generated on a version must still be usable when the next one "
                "lands; lower publish_every or raise S"
            )
        if self.target_step_kl is not None and self.target_mismatch_kl is not None:
            raise ValueError(
                "target_step_kl and target_mismatch_kl both set: the learning rate follows one "
                "signal; set the other to none"
            )
        if self.eval_every is not None and not self.eval_task:
            raise ValueError(
                "eval_every is set but eval_task is not: name the task whose held-out split is "
                "scored (the coordinator's task, e.g. arith)"
            )
        if self.minibatches > self.batch_prompts:
            raise ValueError(
                f"minibatches={self.minibatches} > batch_prompts={self.batch_prompts}: a minibatch "
                "holds whole groups; lower minibatches"
            )
        return self

    @property
    def processing(self) -> dict[str, float | int]:
        """``temperature``/``top_p``/``top_k`` in effect (unset ones: plain sampling)."""
        return {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": 0 if self.top_k is None else self.top_k,
        }

    @property
    def kappa(self) -> int:
        """κ, the effective publication interval in steps."""
        return self.publish_every or max(1, self.max_staleness - 1)

    @property
    def eps_high(self) -> float:
        """ε_high, the effective upper clip."""
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> TrainerConfig:
        """Load flat keys from ``path``; ``overrides`` (e.g. CLI flags) win over the file. TOML
        has no null: the string ``"none"`` switches off a setting whose None means off (e.g.
        ``target_step_kl = "none"``)."""
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
        data = nones(data)
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(data)
