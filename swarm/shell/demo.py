"""``swarm demo``: a real local swarm on 127.0.0.1, as separate processes.

One coordinator, one trainer and N contributor nodes (plus K misbehaving ones with
``--byzantine K``), each its own process and its own hivemind peer. Checkpoints travel through the
peer-assisted broadcast, rollouts through the full verified intake. The demo itself is only an
orchestrator and a viewer: it writes the configs, starts the processes (each in its own session,
so it can end exactly its own process trees by PID), watches the coordinator's ``/status``, and
stops everything on Ctrl-C, on reaching the target, or at the time limit.

Run folder (``runs/demo-TIME``): ``coordinator/`` ``trainer/`` ``node-*/`` state, ``logs/*.log``,
``curve.jsonl`` (one row per learner step seen on ``/status``), ``demo.png`` and ``summary.md``.
The flags and profiles are :mod:`swarm.shell.demo_options`, the live view and report
:mod:`swarm.shell.demo_report`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from swarm.files import atomic_write_text
from swarm.shell.demo_options import BYZANTINE_MODES, DemoOptions, toml_value

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 90.0
#: trainer figures recorded in curve.jsonl next to reward and exact match
MONITOR_FIGURES = (
    "ess_frac", "mismatch_kl", "clip_frac", "mask_frac", "grad_norm", "entropy", "step_kl",
    "stability_warning", "dropped_uniform", "lr_factor",
)  # fmt: skip
#: the held-out evaluation's figures recorded in curve.jsonl (the latest at each learner step)
EVAL_FIGURES = (
    "eval_version", "eval_greedy_acc", "eval_greedy_lo", "eval_greedy_hi", "eval_pass1",
    "eval_s",
)  # fmt: skip
#: seconds past a process's own stop bound (``swarm.signals.STOP_BOUND_S``) before it is killed
STOP_MARGIN_S = 2.0


class Process:
    """A child process in its own session; logs to a file; ended by PID (its process group)."""

    def __init__(self, name: str, argv: list[str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop())
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env=env,
        )  # fmt: skip

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """Signal the child itself (not its group: its libp2p daemon must outlive the shutdown)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def wait(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout=max(timeout, 0.01))
            return True
        except subprocess.TimeoutExpired:
            return False

    def kill_group(self) -> None:
        """SIGKILL what is left of this child's session (p2pd daemons included)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.poll()

    def close(self) -> None:
        self._log.close()

    def tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


class Demo:
    """Writes configs, starts and watches the processes, summarises the run."""

    def __init__(self, opts: DemoOptions) -> None:
        self.opts = opts
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(opts.run_dir or Path("runs") / f"demo-{stamp}").resolve()
        self.logs = self.run_dir / "logs"
        self.procs: list[Process] = []
        self.curve: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self.status: dict[str, Any] = {}
        self.reached_at: float | None = None
        self.coordinator: dict[str, Any] = {}
        #: node name -> URL of its status page, once the node has written its node.json
        self.node_pages: dict[str, str] = {}

    # --- set-up ----------------------------------------------------------------------------------
    def _write_configs(self, trainer_fp: str) -> None:
        o = self.opts
        assert o.batch_prompts is not None and o.group_size is not None
        model = f'model_path = "{o.model_dir}"\n' if o.model_dir else ""
        spot = 0.25 if o.byzantine else 0.05  # floor of the adaptive check rate
        # a real model on CPU makes tens of tokens per second, not thousands: longer leases
        real = o.model_dir is not None
        leases = (
            "min_deadline_s = 180.0\ntarget_lease_s = 20.0\nmax_prompts_per_lease = 2\n"
            "default_tokens_per_s = 20.0\n"
            if real
            else "min_deadline_s = 10.0\ntarget_lease_s = 0.5\nmax_prompts_per_lease = 8\n"
            "default_tokens_per_s = 2000.0\n"
        )
        # A real model's calibration on this CPU: 256 samples in fp32, bf16 and fp16 would take
        # about an hour (bf16 and fp16 matmuls are slow here; 16 samples in fp32 and bf16 took
        # 128 s), every check of v0 waiting for it. The demo's nodes compute in fp32 (node.dtype's
        # default), so fp32 is what they are held to, measured on 32 samples (~25 s for SmolLM2
        # on one thread, once per 16 versions).
        calibration = 'accepted_dtypes = ["float32"]\ncalibration_samples = 32\n' if real else ""
        prompt = (
            f"\n[prompt]\nsystem_prompt = {json.dumps(o.system_prompt)}\n"
            if o.system_prompt
            else ""
        )
        (self.run_dir / "coordinator.toml").write_text(
            f'task = "{o.task}"\ntask_seed = {o.seed}\n{model}group_size = {o.group_size}\n'
            # S = 0 (on-policy): the learner trains only on its current version's rollouts; the
            # coordinator's smallest bound is 1 (a lease of v-1 still lands, then is stale)
            f"staleness_bound = {max(1, o.staleness or 0)}\nheartbeat_interval_s = 2.0\n"
            "heartbeat_misses = 3\n"
            f"\n[sampling]\nmax_new_tokens = {o.max_new_tokens}\ntemperature = {o.temperature}\n"
            f"\n[leases]\n{leases}{prompt}"
            # every process shares this CPU: the replay's bf16 second forward (issue 34's local
            # slack) would cost ~6x an fp32 re-score here, so the demo keeps the global slack
            f"\n[intake]\nspot_check_fraction = {spot}\ncalibration_local = false\n"
            f"{calibration}"
            f"\n[reputation]\nstrikes_to_ban = 3\nban_base_s = 60.0\n"
            f"\n[capacity]\nbatch_rollouts = {o.batch_prompts * o.group_size}\nt_train_s = 0.1\n"
            f'\n[network]\ntrainer_key = "{trainer_fp}"\n'
        )
        settings: dict[str, Any] = {
            key: value
            for key, value in (
                ("lr", o.lr), ("entropy_coef", o.entropy_coef), ("minibatches", o.minibatches),
                ("target_step_kl", o.target_step_kl), ("lora_rank", o.lora_rank),
                ("lora_alpha", o.lora_alpha),
            )
            if value is not None
        }  # fmt: skip
        if o.eval_every is not None:  # the held-out evaluation (trainer/evaluation.py)
            settings.update(eval_every=o.eval_every, eval_task=o.task)
            settings.update({k: v for k, v in (
                ("eval_prompts", o.eval_prompts), ("eval_samples", o.eval_samples),
                ("eval_system_prompt", o.system_prompt),
            ) if v is not None})  # fmt: skip
        settings.update(o.trainer_overrides)  # a benchmark's overrides win over the profile
        learner = "".join(f"{k} = {toml_value(v)}\n" for k, v in settings.items())
        (self.run_dir / "trainer.toml").write_text(
            f"{model}seed = {o.seed}\nbatch_prompts = {o.batch_prompts}\n"
            f"group_size = {o.group_size}\nmax_staleness = {o.staleness}\n"
            f'out_dir = "{self.run_dir / "trainer"}"\nresume = false\n'
            f"checkpoint_every = {1000 if real else 50}\n{learner}"
        )

    def _spawn(self, name: str, args: list[str]) -> Process:
        argv = [sys.executable, "-m", "swarm.shell.cli", *args]
        proc = Process(name, argv, self.logs / f"{name}.log")
        self.procs.append(proc)
        log.info("started %s (pid %d)", name, proc.pid)
        return proc

    def start(self) -> None:
        from protocol.identity import Identity

        self.logs.mkdir(parents=True, exist_ok=True)
        trainer_key = Identity.load_or_create(self.run_dir / "trainer" / "trainer.key")
        self._write_configs(trainer_key.fingerprint)
        coord_dir = self.run_dir / "coordinator"
        self._spawn(
            "coordinator",
            ["coordinator", "launch", "--config", str(self.run_dir / "coordinator.toml"),
             "--state-dir", str(coord_dir)],
        )  # fmt: skip
        info_path = coord_dir / "coordinator.json"

        def read_info() -> bool:  # written whole (renamed into place); parsed, in case it is not
            try:
                self.coordinator = json.loads(info_path.read_text())
            except (OSError, ValueError):
                return False
            return True

        self._wait_for(read_info, "the coordinator to come up")
        maddr, fp = self.coordinator["multiaddrs"][0], self.coordinator["fingerprint"]
        print(
            f"dashboard: {self.coordinator['http_url']}/  (open it in a browser while the demo "
            "runs)",
            flush=True,
        )
        self._spawn(
            "trainer",
            ["trainer", "run", "--config", str(self.run_dir / "trainer.toml"), "--coordinator",
             maddr, "--coordinator-key", fp, "--state-dir", str(self.run_dir / "trainer")]
            + (["--max-steps", str(self.opts.max_steps)] if self.opts.max_steps else []),
        )  # fmt: skip
        self._start_nodes(maddr, fp)
        atomic_write_text(
            self.run_dir / "demo.json",
            json.dumps(
                {"coordinator": self.coordinator, "pids": {p.name: p.pid for p in self.procs}},
                indent=2,
            ),
        )

    def _start_nodes(self, maddr: str, fp: str) -> None:
        """Write each node's config (backend cycled from ``node_backends``) and start it."""
        assert self.opts.nodes is not None
        names = [f"node-{i}" for i in range(self.opts.nodes)]
        names += [f"byzantine-{i}" for i in range(self.opts.byzantine)]
        for i, name in enumerate(names):
            cfg = self.run_dir / f"{name}.toml"
            backend = self.opts.node_backends[i % len(self.opts.node_backends)]
            lines = [f'backend = "{backend}"\n', 'host_maddrs = ["/ip4/127.0.0.1/tcp/0"]\n',
                     "status_interval_s = 5.0\n", "status_port = 0\n"]  # fmt: skip
            if self.opts.model_dir:
                lines.append(f'model_path = "{self.opts.model_dir}"\n')
            if name.startswith("byzantine"):
                mode = BYZANTINE_MODES[(i - self.opts.nodes) % len(BYZANTINE_MODES)]
                lines.append(f'misbehave = ["{mode}"]\n')
            cfg.write_text("".join(lines))
            self._spawn(
                name,
                ["node", "run", "--coordinator", maddr, "--coordinator-key", fp, "--config",
                 str(cfg), "--state-dir", str(self.run_dir / name)],
            )  # fmt: skip

    def _wait_for(self, ready: Any, what: str) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not ready():
            self._check_children()
            if time.monotonic() > deadline:
                raise DemoError(f"timed out after {STARTUP_TIMEOUT_S:.0f}s waiting for {what}")
            time.sleep(0.2)

    def _check_children(self) -> None:
        for p in self.procs:
            if not p.alive() and p.proc.returncode != 0:
                raise DemoError(
                    f"{p.name} exited with code {p.proc.returncode}; last lines of "
                    f"{p.log_path}:\n{p.tail()}"
                )

    # --- watching --------------------------------------------------------------------------------
    def find_node_pages(self) -> dict[str, str]:
        """Status pages that came up since the last call (``{node name: URL}``)."""
        new = {}
        for p in self.procs:
            if p.name in self.node_pages or not p.name.startswith(("node", "byzantine")):
                continue
            try:
                url = json.loads((self.run_dir / p.name / "node.json").read_text())["status_url"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            self.node_pages[p.name] = new[p.name] = f"{url}/"
        return new

    def poll(self) -> dict[str, Any]:
        url = self.coordinator.get("http_url", "") + "/status"
        try:
            with urllib.request.urlopen(url, timeout=2.0) as resp:
                self.status = json.loads(resp.read())
        except (OSError, ValueError) as exc:
            log.debug("status poll failed: %s", exc)
            return self.status
        row = {
            "t": round(time.monotonic() - self.t0, 2),
            "step": self.status.get("trainer_step"),
            "version": self.status.get("policy_version"),
            "reward": self.status.get("trainer_reward_mean"),
            "exact": self.status.get("trainer_exact_match"),
            "staleness": self.status.get("trainer_staleness_mean"),
            "accepted": self.status.get("rollouts_accepted"),
            "rejected": sum((self.status.get("rejected_by_reason") or {}).values()),
            # the trainer's stability monitors (trainer/monitors.py)
            **{k: self.status.get(f"trainer_{k}") for k in MONITOR_FIGURES},
            # the latest held-out evaluation (trainer/evaluation.py) and the version it scored
            **{k: self.status.get(f"trainer_{k}") for k in EVAL_FIGURES},
        }
        if not self.curve or self.curve[-1]["step"] != row["step"]:
            self.curve.append(row)
            with open(self.run_dir / "curve.jsonl", "a") as fh:
                fh.write(json.dumps(row) + "\n")
        return self.status

    def reached_target(self) -> bool:
        recent = [r["exact"] for r in self.curve[-3:] if r["exact"] is not None]
        hit = len(recent) == 3 and sum(recent) / 3 >= self.opts.target
        if hit and self.reached_at is None:
            self.reached_at = time.monotonic() - self.t0
        return hit

    def reached_eval_target(self) -> bool:
        """The latest held-out greedy accuracy of a trained version (not the base) is at least
        ``--eval-target``."""
        target = self.opts.eval_target
        acc, version = (self.status.get(f"trainer_eval_{k}") for k in ("greedy_acc", "version"))
        hit = (
            target is not None
            and isinstance(acc, int | float)
            and isinstance(version, int)
            and version > 0
            and acc >= target
        )
        if hit and self.reached_at is None:
            self.reached_at = time.monotonic() - self.t0
        return hit

    def done_reason(self) -> str | None:
        if self.reached_eval_target():
            return f"held-out accuracy reached {self.opts.eval_target:.2f}"
        if self.reached_target():
            return f"exact match reached {self.opts.target:.2f}"
        if time.monotonic() - self.t0 > (self.opts.time_limit or 0.0):
            return f"time limit of {self.opts.time_limit:.0f}s"
        problems = self.status.get("node_problems") or {}
        gave_up = [str(p) for p in problems.values() if str(p).startswith("stopped taking")]
        if gave_up and len(gave_up) >= (self.opts.nodes or 1):
            raise DemoError(f"the nodes stopped taking leases: {gave_up[0]}")
        step = self.status.get("trainer_step")
        if self.opts.max_steps is not None and step is not None and step >= self.opts.max_steps:
            return f"{self.opts.max_steps} learner steps done"
        trainer = next((p for p in self.procs if p.name == "trainer"), None)
        if trainer is not None and not trainer.alive():
            if trainer.proc.returncode == 0:
                return "trainer finished"
            self._check_children()
        for p in self.procs:
            if p.name.startswith(("node", "coordinator")) and not p.alive():
                self._check_children()
        return None

    # --- shutdown --------------------------------------------------------------------------------
    def stop(self) -> None:
        """SIGTERM the nodes and the trainer (they still reach the coordinator to hand back
        leases and finish a publication), then the coordinator; each gets its own stop bound
        (``swarm.signals.STOP_BOUND_S``) plus ``STOP_MARGIN_S``, then SIGKILL to what is left
        of its session. By PID only. At most ``STOP_BOUND_S["demo"]`` in all."""
        from swarm.signals import STOP_BOUND_S

        def role(p: Process) -> str:
            return p.name if p.name in ("trainer", "coordinator") else "node"

        for group in (
            [p for p in self.procs if p.name != "coordinator"],
            [p for p in self.procs if p.name == "coordinator"],
        ):
            for p in group:
                p.signal(signal.SIGTERM)
            started = time.monotonic()
            for p in group:
                bound = STOP_BOUND_S[role(p)] + STOP_MARGIN_S
                if not p.wait(started + bound - time.monotonic()):
                    log.warning("%s did not stop in %.0fs; killing it", p.name, bound)
            for p in group:
                p.kill_group()  # the daemons a child started live in its session
                p.close()

    # --- report ----------------------------------------------------------------------------------
    def summary(self, reason: str) -> str:
        from swarm.shell.demo_report import summarise

        return summarise(self, reason)


class DemoError(RuntimeError):
    """The demo could not run (a process failed to start or died); the message says which."""


def run_demo(opts: DemoOptions) -> int:
    """Run the demo; 0 when the target was reached (or max steps done), 1 otherwise."""
    from swarm.shell.demo_report import LiveView

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    demo = Demo(opts)
    try:  # fail here, in one line, rather than half-way through start()
        demo.logs.mkdir(parents=True, exist_ok=True)
        probe = demo.logs / ".write-test"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        print(
            f"error: cannot create the run folder {demo.run_dir} ({exc.strerror or exc}); "
            "pass --run-dir with a new folder in a writable place",
            file=sys.stderr,
            flush=True,
        )
        return 2
    interrupted = False

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    reason = "stopped"
    view = LiveView(demo, enabled=opts.live)
    try:
        print(f"run folder: {demo.run_dir}", flush=True)
        demo.start()
        with view:
            while True:
                demo.poll()
                view.update()
                r = demo.done_reason()
                if r is not None:
                    reason = r
                    break
                time.sleep(1.0)
    except KeyboardInterrupt:
        interrupted = True
        reason = "interrupted (Ctrl-C)"
    except (DemoError, OSError) as exc:
        reason = f"failed: {exc}"
    finally:
        # a second Ctrl-C or SIGTERM must not cut the shutdown short (children would be left)
        previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            demo.stop()
        finally:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, previous_int)
    text = demo.summary(reason)
    print("\n" + text, flush=True)
    if interrupted:
        return 130
    if reason.startswith("failed"):
        first = " ".join(reason.splitlines()[0].split())
        print(f"error: demo {first}; logs in {demo.logs}", file=sys.stderr, flush=True)
        return 1
    ok = (
        demo.reached_at is not None or reason.endswith("steps done") or reason == "trainer finished"
    )
    return 0 if ok and not reason.startswith("failed") else 1
