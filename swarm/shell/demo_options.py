"""The options of ``swarm demo``: its two profiles, flag checks, and ``--trainer-set``.

:class:`DemoOptions` is validated on construction (a wrong flag is a one-line ``ValueError``);
a flag left ``None`` takes the profile's value (``embedded``, or ``pretrained`` with ``--model``).
:func:`parse_trainer_settings` turns ``--trainer-set KEY=VALUE`` into trainer config entries,
refusing the keys the demo derives from its own flags. The orchestrator is :mod:`swarm.shell.demo`.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BYZANTINE_MODES = ("forge_logprobs", "inflate_reward", "wrong_version", "oov_tokens", "greedy")

#: Defaults of the embedded model (a 133k-parameter model learning to reverse strings) and of a
#: real pretrained model (``--model``: a 135M instruct model on a 2-core CPU: one node and the
#: trainer on one torch thread each, 4 prompts x 8 samples = 32 per learner step, LoRA rank 8 at
#: 10x the full fine-tuning learning rate ("LoRA Without Regret"), no entropy bonus, the held-out
#: score every 5 versions; docs/models.md, "swarm demo --model smollm2"). A flag given on the
#: command line wins; ``--trainer-set`` wins over the learner settings (e.g. ``lora_rank=0
#: lr=2e-5`` for full fine-tuning).
PROFILES: dict[str, dict[str, Any]] = {
    "embedded": {
        "nodes": 3, "staleness": 2, "group_size": 8, "batch_prompts": 32, "task": "reverse3",
        "time_limit": 300.0, "temperature": 1.0, "lr": None, "entropy_coef": None,
        "minibatches": None, "system_prompt": None,
        # measured on this task (docs/trainer.md, "A KL-adaptive learning rate"): no fall in
        # swarm demo over 5 seeds nor in bench/staleness.py at S = 4/8; off in TrainerConfig
        "target_step_kl": 0.02,
        # reverse3 has no held-out split (its whole space is 64 strings): no evaluation
        "lora_rank": None, "lora_alpha": None, "eval_every": None, "eval_prompts": None,
        "eval_samples": None,
    },
    "pretrained": {
        "nodes": 1, "staleness": 2, "group_size": 8, "batch_prompts": 4, "task": "arith",
        "time_limit": 1800.0, "temperature": 0.7, "max_new_tokens": 32, "lr": 2e-4,
        "entropy_coef": 0.0, "minibatches": 1,
        "system_prompt": "Answer with the final number only.", "target_step_kl": None,
        "lora_rank": 8, "lora_alpha": 32.0,
        "eval_every": 5, "eval_prompts": 100, "eval_samples": 2,
    },
}  # fmt: skip


@dataclass
class DemoOptions:
    """Flags of ``swarm demo`` (validated on construction; ``None``: the profile's default, see
    :data:`PROFILES`)."""

    nodes: int | None = None
    staleness: int | None = None
    group_size: int | None = None
    batch_prompts: int | None = None
    task: str | None = None
    model_dir: Path | None = None
    #: a local HF model directory or a named model (``smollm2``; policy/importer.py)
    model: str | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    byzantine: int = 0
    seed: int = 0
    target: float = 0.9
    time_limit: float | None = None
    max_steps: int | None = None
    run_dir: Path | None = None
    live: bool = True
    extra_node_args: list[str] = field(default_factory=list)
    #: backend of each honest node, cycled (``--node-backend``; e.g. vllm,hf on a GPU host)
    node_backends: list[str] = field(default_factory=lambda: ["hf"])
    #: extra flat keys for the trainer's TOML (benchmarks: e.g. ``{"overlap": False}``)
    trainer_overrides: dict[str, Any] = field(default_factory=dict)
    #: learner settings of the profile (not flags)
    lr: float | None = None
    entropy_coef: float | None = None
    minibatches: int | None = None
    #: the KL-adaptive learning rate's target (TrainerConfig.target_step_kl; None: the trainer's)
    target_step_kl: float | None = None
    #: system message of the chat template (coordinator ``prompt.system_prompt``)
    system_prompt: str | None = None
    #: the model's fingerprint when it is an imported one (policy/importer.py)
    model_fingerprint: str | None = None
    #: LoRA rank and alpha of the learner (TrainerConfig.lora_rank/lora_alpha; None: theirs)
    lora_rank: int | None = None
    lora_alpha: float | None = None
    #: the held-out evaluation: every this many versions (None: off), prompts, pass@1 samples
    eval_every: int | None = None
    eval_prompts: int | None = None
    eval_samples: int | None = None
    #: stop once the held-out greedy accuracy reaches this (``--eval-target``; None: never)
    eval_target: float | None = None

    def __post_init__(self) -> None:
        self._resolve_model()
        profile = PROFILES["embedded" if self.model_dir is None else "pretrained"]
        for key, value in profile.items():
            if getattr(self, key, None) is None:
                setattr(self, key, value)
        if self.max_new_tokens is None:
            self.max_new_tokens = max_new_tokens_for(str(self.task))
        self._validate()
        self._preflight()

    def _resolve_model(self) -> None:
        if self.model is None:
            return
        if self.model_dir is not None:
            raise ValueError("give --model or --model-dir, not both")
        from policy.importer import SHORTCUTS, ModelImportError, models_home, resolve_model

        if self.model in SHORTCUTS and not (models_home() / f"{self.model}-float32").is_dir():
            print(f"importing {self.model} once into {models_home()} (about a minute) ...",
                  flush=True)  # fmt: skip
        try:
            path, self.model_fingerprint = resolve_model(self.model)
        except ModelImportError as exc:
            raise ValueError(str(exc)) from exc
        self.model_dir = path

    def _validate(self) -> None:
        assert self.nodes is not None and self.staleness is not None
        assert self.group_size is not None and self.batch_prompts is not None
        assert self.time_limit is not None and self.max_new_tokens is not None
        if not 1 <= self.nodes <= 64:
            raise ValueError(f"--nodes must be between 1 and 64, got {self.nodes}")
        if not 0 <= self.staleness <= 16:
            raise ValueError(f"--staleness must be between 0 and 16, got {self.staleness}")
        if self.group_size < 2:
            raise ValueError(
                f"--group-size must be at least 2 (GRPO needs a group), got {self.group_size}"
            )
        if self.batch_prompts < 1:
            raise ValueError(f"--batch-prompts must be positive, got {self.batch_prompts}")
        bad = [b for b in self.node_backends if b not in ("hf", "vllm")]
        if bad or not self.node_backends:
            raise ValueError(f"--node-backend must be hf or vllm, got {bad or 'none'}")
        if not 0 <= self.byzantine <= 16:
            raise ValueError(f"--byzantine must be between 0 and 16, got {self.byzantine}")
        if not 0 < self.target <= 1:
            raise ValueError(f"--target must be in (0, 1], got {self.target}")
        if self.eval_target is not None:
            if not 0 < self.eval_target <= 1:
                raise ValueError(f"--eval-target must be in (0, 1], got {self.eval_target}")
            if self.eval_every is None:
                raise ValueError(
                    f"--eval-target needs the held-out evaluation, which task {self.task} has "
                    "not (use --model with arith, arith-words or jsonl:PATH)"
                )
        if not self.time_limit > 0:  # NaN too: it would never stop
            raise ValueError(f"--time-limit must be positive, got {self.time_limit}")
        if not 1 <= self.max_new_tokens <= 4096:
            raise ValueError(
                f"--max-new-tokens must be between 1 and 4096, got {self.max_new_tokens}"
            )
        if self.temperature is not None and not self.temperature > 0:
            raise ValueError(f"--temperature must be positive, got {self.temperature}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"--max-steps must be at least 1, got {self.max_steps}")
        if self.run_dir is not None:
            if self.run_dir.exists() and not self.run_dir.is_dir():
                raise ValueError(f"--run-dir {self.run_dir} is a file; give a new folder")
            try:
                not_empty = self.run_dir.is_dir() and any(self.run_dir.iterdir())
            except OSError as exc:
                raise ValueError(
                    f"--run-dir {self.run_dir}: cannot read it ({exc.strerror})"
                ) from exc
            if not_empty:
                # its coordinator.json, SQLite state and checkpoints would be taken for this run's
                raise ValueError(
                    f"--run-dir {self.run_dir} is not empty (an earlier run?); give a new folder"
                )
        if self.model_dir is not None:
            if not self.model_dir.is_dir():
                raise ValueError(f"--model-dir {self.model_dir}: no such directory")
            if not (self.model_dir / "config.json").is_file():
                raise ValueError(
                    f"--model-dir {self.model_dir} has no config.json (a local HF model dir)"
                )

    def _preflight(self) -> None:
        """The coordinator's start-up checks (policy/preflight.py), run before any process
        starts, with the demo's flags named."""
        from coordinator.tasks import make_task
        from policy.model import ModelSpec
        from policy.preflight import prepare

        try:
            task = make_task(str(self.task))  # raises ValueError naming the task
        except OSError as exc:
            raise ValueError(
                f"--task {self.task}: cannot read {exc.filename or 'the file'} "
                f"({exc.strerror or exc})"
            ) from exc
        names = {
            "task": "--task",
            "model": "--model",
            "max_new_tokens": "--max-new-tokens",
            "stop": "the model's EOS ids",
            "template": "the prompt template",
        }
        try:
            spec = ModelSpec(path=None if self.model_dir is None else str(self.model_dir))
            prepare(
                spec,
                task=task,
                max_new_tokens=int(self.max_new_tokens or 1),
                system_prompt=self.system_prompt,
                names=names,
            )
            self._check_heldout(task)
        finally:
            close = getattr(task, "close", None)
            if callable(close):
                close()

    def _check_heldout(self, task: Any) -> None:
        """With the held-out evaluation on (the profile's or ``--trainer-set``'s), the task must
        hold out enough problems: refused here, not when the trainer starts."""
        settings = {"eval_every": self.eval_every, "eval_prompts": self.eval_prompts}
        settings.update({k: v for k, v in self.trainer_overrides.items() if k in settings})
        every, prompts = settings["eval_every"], settings["eval_prompts"]
        if every is None or (isinstance(every, str) and every.lower() == "none"):
            return
        from coordinator.tasks import heldout_problems

        try:
            heldout_problems(task, int(prompts or 100))
        except ValueError as exc:
            raise ValueError(
                f"--task {self.task}: {exc} (or --trainer-set eval_every=none: no held-out score)"
            ) from None


#: trainer settings the demo derives from its own flags (``--trainer-set`` may not set them)
DEMO_TRAINER_KEYS = {
    "seed": "--seed", "batch_prompts": "--batch-prompts", "group_size": "--group-size",
    "max_staleness": "--staleness", "model_path": "--model/--model-dir", "out_dir": "--run-dir",
    "resume": "(a demo starts afresh)", "checkpoint_every": "(set by the demo)",
    "eval_task": "--task", "eval_system_prompt": "(the coordinator's system prompt)",
}  # fmt: skip


def parse_trainer_settings(pairs: list[str]) -> dict[str, Any]:
    """``--trainer-set KEY=VALUE`` flags as trainer overrides: VALUE is read as a TOML value
    (``true``, ``0.05``, ``"informative"``; a bare word is a string). Checked against
    :class:`trainer.config.TrainerConfig` here, so a typo fails before any process starts."""
    from pydantic import ValidationError

    from trainer.config import TrainerConfig, nones

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key, text = key.strip(), text.strip()
        if not sep or not key or not text:
            raise ValueError(f"--trainer-set {pair!r}: expected KEY=VALUE, e.g. filter_groups=true")
        if key not in TrainerConfig.model_fields:
            raise ValueError(
                f"--trainer-set {key}: not a trainer setting (see trainer/trainer.example.toml)"
            )
        if key in DEMO_TRAINER_KEYS:
            raise ValueError(f"--trainer-set {key}: the demo sets it, {DEMO_TRAINER_KEYS[key]}")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        out[key] = value
    probe = nones(out)
    if probe.get("eval_every") is not None:  # the demo names the task (eval_task = --task)
        probe.setdefault("eval_task", "the demo's --task")
    try:
        TrainerConfig(**probe)  # "none" is written as is; TrainerConfig.from_toml reads None
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "settings"
        raise ValueError(f"--trainer-set {where}: {err['msg']}") from None
    return out


def toml_value(value: Any) -> str:
    """A scalar as TOML (the trainer overrides of a benchmark)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))


def max_new_tokens_for(task: str) -> int:
    if task.startswith("reverse"):
        return int(task.removeprefix("reverse") or 3) + 2
    return 256
