"""The ``meshnode`` command line: thin typer commands over the library.

Domain errors (a bad config, a missing corpus, an unknown model) are printed as one line and exit
with code 1; no traceback reaches the user unless ``--debug`` is given. The environment is read here
only (``MESHNODE_CACHE``), never at import time elsewhere.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from . import __version__
from .config import ConfigError, load_config

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Adapt a pretrained LLM on a swarm of peers.")
data_app = typer.Typer(no_args_is_help=True, help="Corpora: fetch and prepare (tokenise, pack, cache).")
app.add_typer(data_app, name="data")

logger = logging.getLogger("meshnode")

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="Run config TOML file.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Override a config key: --set train.lr=3e-4")]
PeersOpt = Annotated[
    list[str] | None, typer.Option("--initial-peers", help="Multiaddr of a peer of the swarm (repeatable).")
]
CacheOpt = Annotated[
    Path | None,
    typer.Option("--cache-dir", help="Cache for models and data (default $MESHNODE_CACHE or ~/.cache/meshnode)."),
]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"meshnode {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")
    ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log at INFO level.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks of errors.")] = False,
) -> None:
    level = logging.DEBUG if debug else logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app.info_name = "meshnode"
    _State.debug = debug


class _State:
    debug = False


def cache_dir_from(option: Path | None) -> Path:
    if option is not None:
        return option.expanduser()
    env = os.environ.get("MESHNODE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "meshnode"


@contextmanager
def user_errors():
    """Turn the errors a user can fix into one line and exit code 1."""
    from .data import CorpusError
    from .model import ModelLoadError

    try:
        yield
    except (ConfigError, CorpusError, ModelLoadError, FileNotFoundError, ValueError, KeyError) as exc:
        if _State.debug:
            raise
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        typer.secho(f"error: {msg}", err=True, fg=typer.colors.RED)
        raise typer.Exit(1) from None


# ---------------------------------------------------------------------------------------------
# train


@app.command()
def train(
    config: ConfigOpt,
    steps: Annotated[int | None, typer.Option(help="Total optimizer steps (overrides train.steps).")] = None,
    set_: SetOpt = None,
    metrics_out: Annotated[Path | None, typer.Option("--metrics-out", help="Write metrics as JSON lines.")] = None,
    checkpoint_dir: Annotated[Path | None, typer.Option("--checkpoint-dir", help="Save checkpoints here.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Resume from --checkpoint-dir.")] = False,
    stop_at: Annotated[
        int | None, typer.Option("--stop-at", help="Stop (and checkpoint) after this step; resume later.")
    ] = None,
    cache_dir: CacheOpt = None,
) -> None:
    """Train in one process: the dense reference, or the X x Y mesh with masks, anchor and DP."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with user_errors():
        overrides = list(set_ or [])
        if steps is not None:
            overrides.append(f"train.steps={steps}")
        cfg = load_config(config, overrides)
        if resume and checkpoint_dir is None:
            raise ConfigError("--resume needs --checkpoint-dir")
        from .mesh import MeshTrainer

        trainer = MeshTrainer(cfg, cache_dir_from(cache_dir))
        if resume:
            trainer.load_checkpoint(checkpoint_dir)
    out = metrics_out.open("a" if resume else "w") if metrics_out else None
    final: dict = {}

    with Progress(
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(), console=console, transient=False, disable=not console.is_terminal,
    ) as progress:
        task = progress.add_task("train", total=cfg.train.steps, completed=trainer.step, info="")

        def emit(rec: dict) -> None:
            nonlocal final
            if out:
                out.write(json.dumps(rec) + "\n")
                out.flush()
            if "loss" in rec:
                progress.update(task, completed=rec["step"] + 1, info=f"loss {rec['loss']:.4f}")
                if not console.is_terminal and (rec["step"] + 1) % 10 == 0:
                    console.print(f"step {rec['step'] + 1}/{cfg.train.steps} loss {rec['loss']:.4f}")
            elif "heldout_loss" in rec and not rec.get("final"):
                console.print(f"step {rec['step']}: held-out loss {rec['heldout_loss']:.4f}")
            if rec.get("final"):
                final = rec

        try:
            trainer.train(until=stop_at, metrics=emit, checkpoint_dir=checkpoint_dir)
        except KeyboardInterrupt:
            if checkpoint_dir:
                trainer.save_checkpoint(checkpoint_dir)
                console.print(f"interrupted: checkpoint at step {trainer.step} in {checkpoint_dir}")
            raise typer.Exit(130) from None
        finally:
            if out:
                out.close()
    bpt = final.get("bytes_per_token", {})
    console.print(
        f"done: {final.get('steps')} steps, held-out loss {final.get('heldout_loss', float('nan')):.4f}, "
        f"{final.get('tokens_per_s', 0):.0f} tokens/s, bytes/token {bpt.get('total', 0):.1f}"
    )
    if "heldout_loss_mean" in final:
        console.print("held-out loss of replica 0 above; of the replicas' exact mean "
                      f"{final['heldout_loss_mean']:.4f} (meshnode export --average writes it)")


# ---------------------------------------------------------------------------------------------
# export


@app.command()
def export(
    out: Annotated[Path, typer.Option("--out", help="Hugging Face directory to write.")],
    checkpoint: Annotated[Path | None, typer.Option("--checkpoint", help="A checkpoint of meshnode train.")] = None,
    initial_peers: PeersOpt = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Run config (with --initial-peers).")] = None,
    set_: SetOpt = None,
    cache_dir: CacheOpt = None,
    average: Annotated[bool, typer.Option(
        "--average", help="The DP replicas' exact mean instead of one replica's weights: of a checkpoint, all its "
        "replicas; of a swarm, each stage's replicas that keep up with its DP syncs (this client averages)."),
    ] = False,
) -> None:
    """Write a plain Hugging Face model directory: from a checkpoint, or from a running swarm's peers."""
    with swarm_errors():
        if checkpoint is None and not initial_peers:
            raise ConfigError("export needs --checkpoint DIR, or --initial-peers MADDR with --config RUN.toml")
        if checkpoint is not None:
            from .mesh import export_checkpoint

            path = export_checkpoint(checkpoint, out, average=average)
        else:
            if config is None:
                raise ConfigError("export --initial-peers needs --config RUN.toml (the run's config)")
            cfg = load_config(config, list(set_ or []))
            from .node.inspect import export_from_swarm

            path = export_from_swarm(cfg, list(initial_peers), out, cache_dir_from(cache_dir), average)["out"]
    typer.echo(f"wrote {path}")


# ---------------------------------------------------------------------------------------------
# the swarm: join, status, demo


@contextmanager
def swarm_errors():
    """user_errors plus the swarm's own errors (unreachable peers, a stage without peer)."""
    from .node.swarm import SwarmError

    try:
        with user_errors():
            yield
    except SwarmError as exc:
        if _State.debug:
            raise
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(1) from None


DEFAULT_REBALANCE_AFTER = 30.0


def rebalance_delay(after: float | None, never: bool, *, stage_fixed: bool, role: str) -> float | None:
    """``meshnode join``'s rebalancing delay (None: never move): ``--rebalance-after`` when given; else 30 s for a fast
    peer whose stage was chosen for it; never with ``--no-rebalance``, for a driver or an anchor, or for a fixed
    ``--stage`` without ``--rebalance-after``."""
    if after is not None and not (math.isfinite(after) and after >= 0):
        raise ConfigError(f"--rebalance-after: {after} is not a number of seconds >= 0")
    if after is not None and never:
        raise ConfigError("--rebalance-after and --no-rebalance contradict each other")
    if after is not None and role != "fast":
        raise ConfigError(f"--rebalance-after: a {role} peer never moves to another stage")
    if never or role != "fast":
        return None
    if after is None and not stage_fixed:
        return DEFAULT_REBALANCE_AFTER
    return after


@app.command()
def join(
    config: ConfigOpt,
    initial_peers: PeersOpt = None,
    host_maddrs: Annotated[
        list[str] | None, typer.Option("--host-maddrs", help="Multiaddrs to listen on (default 127.0.0.1, any port).")
    ] = None,
    stage: Annotated[str, typer.Option("--stage", help="Stage to serve: a number, or auto.")] = "auto",
    role: Annotated[str, typer.Option("--role", help="fast | anchor | driver")] = "fast",
    device: Annotated[str, typer.Option("--device", help="cpu | cuda")] = "cpu",
    identity: Annotated[
        Path | None,
        typer.Option("--identity", help="RSA key file that signs this peer's records (created if missing)."),
    ] = None,
    checkpoint_dir: Annotated[Path | None, typer.Option("--checkpoint-dir", help="Save / resume here.")] = None,
    metrics_out: Annotated[Path | None, typer.Option("--metrics-out", help="Driver: per-step JSON lines.")] = None,
    trace_out: Annotated[
        Path | None, typer.Option("--trace-out", help="Per-microbatch send / serve times, as JSON lines.")
    ] = None,
    ready_file: Annotated[Path | None, typer.Option("--ready-file", help="Written once the peer serves.")] = None,
    threads: Annotated[int, typer.Option("--threads", help="torch threads of this peer.")] = 1,
    announce_period: Annotated[float, typer.Option("--announce-period", help="Seconds between announcements.")] = 3.0,
    rebalance_after: Annotated[
        float | None,
        typer.Option("--rebalance-after", help="Move to a stage left without fast peers, or far slower than this "
                     "peer's (by the capacities peers announce), for this many seconds, when this peer's stage has "
                     "others (default: 30 with --stage auto; a fixed --stage only moves when this is given)."),
    ] = None,
    no_rebalance: Annotated[bool, typer.Option("--no-rebalance", help="Never move to another stage.")] = False,
    checkpoint_every: Annotated[
        float,
        typer.Option("--checkpoint-every", help="With --checkpoint-dir: also save the stage's state every this many "
                     "seconds in which it stepped, so a crashed peer restarted on the same directory loses at "
                     "most that much (0: only at a stop)."),
    ] = 300.0,
    slowdown: Annotated[
        float,
        typer.Option("--slowdown", help="Emulate hardware this many times slower (>= 1): each forward and backward "
                     "holds the stage's thread that much longer. For tests and benchmarks of mixed swarms."),
    ] = 1.0,
    set_: SetOpt = None,
    cache_dir: CacheOpt = None,
) -> None:
    """Join a swarm as a peer: serve a stage (or the anchor) until SIGINT / SIGTERM."""
    with swarm_errors():
        cfg = load_config(config, list(set_ or []))
        if role not in ("fast", "anchor", "driver"):
            raise ConfigError(f"--role: {role!r} is not one of fast, anchor, driver")
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            raise ConfigError(f"--device: {device!r} is not cpu or cuda")
        if stage != "auto" and not stage.isdigit():
            raise ConfigError(f"--stage: {stage!r} is not a stage number or auto")
        if stage != "auto" and int(stage) >= cfg.model.stages:
            raise ConfigError(f"--stage: {stage} but the run has stages 0..{cfg.model.stages - 1}")
        rebalance_after = rebalance_delay(rebalance_after, no_rebalance, stage_fixed=stage != "auto", role=role)
        if not (math.isfinite(checkpoint_every) and checkpoint_every >= 0):
            raise ConfigError(f"--checkpoint-every: {checkpoint_every} is not a number of seconds >= 0")
        if not (math.isfinite(slowdown) and 1.0 <= slowdown <= 1000.0):
            raise ConfigError(f"--slowdown: {slowdown} is not a factor between 1 and 1000")
        if cfg.dp.average_moments:
            raise ConfigError("dp.average_moments is an in-process mesh experiment; the swarm's DP averages "
                              "weights only")
        if cfg.mask.reference_refresh and not cfg.mask.reference_refresh_rank:
            raise ConfigError("mask.reference_refresh without mask.reference_refresh_rank (whole copies of the live "
                              "weights, or DP's start weights) is an in-process mesh experiment; a swarm's reference "
                              "moves by rank-r steps (set mask.reference_refresh_rank)")
        from .node.daemon import JoinOptions, run_join

        opts = JoinOptions(
            initial_peers=list(initial_peers or []), host_maddrs=list(host_maddrs or ["/ip4/127.0.0.1/tcp/0"]),
            stage=None if stage == "auto" else int(stage), role=role, device=device, identity=identity,
            checkpoint_dir=checkpoint_dir, cache_dir=cache_dir_from(cache_dir), metrics_out=metrics_out,
            trace_out=trace_out, ready_file=ready_file, threads=threads, announce_period=announce_period,
            rebalance_after=rebalance_after, slowdown=slowdown, checkpoint_every=checkpoint_every or None,
        )
        run_join(cfg, opts)


@app.command()
def status(
    initial_peers: PeersOpt = None,
    run: Annotated[str | None, typer.Option("--run", help="Run id (name-hash), e.g. tiny-0123456789.")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Run config (gives the run id).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
    watch: Annotated[float, typer.Option("--watch", help="Refresh every N seconds (0 = once).")] = 0.0,
    set_: SetOpt = None,
) -> None:
    """Show the swarm from the DHT alone: stages, peers, tokens/s, steps, loss, prior age, bytes/token, health."""
    from rich.console import Console

    with swarm_errors():
        if run is None:
            if config is None:
                raise ConfigError("status needs --run RUN_ID or --config RUN.toml")
            run = load_config(config, list(set_ or [])).run_id
        from .node.inspect import SwarmReader
        from .node.status import render_table, status_json

        console = Console()
        with SwarmReader(list(initial_peers or []), run) as reader:
            while True:
                snap = status_json(reader.peers(), run)
                if as_json:
                    typer.echo(json.dumps(snap))
                else:
                    console.print(render_table(snap))
                if not watch:
                    break
                import time

                time.sleep(watch)


@app.command()
def demo(
    tiny: Annotated[bool, typer.Option("--tiny", help="The tiny random model (fast, for a smoke run).")] = False,
    steps: Annotated[int | None, typer.Option("--steps", help="Optimizer steps of the driver.")] = None,
    method: Annotated[str, typer.Option(
        "--method", help="dense | m95 (M95 + anchor prior) | rotq4 | rotq2 (rotated 4 / 2-bit boundaries) | "
        "rotq4g1 (4-bit activations, 1-bit gradients) | rotq2ref (2 bits, coded against the frozen pretrained "
        "model's boundaries) | rotq1refmap (1 bit against them, less a linear prediction) | rotq1refmaptc (and "
        "both ways in half a bit per coordinate: fitted transform codes) | rotq1refmaptcrr (and the reference "
        "moving every 10 steps by rank-1 moves; one peer per stage).")] = "m95",
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Run config (default: built in).")] = None,
    set_: SetOpt = None,
    metrics_out: Annotated[Path | None, typer.Option("--metrics-out", help="Write the summary JSON here.")] = None,
    workdir: Annotated[
        Path | None, typer.Option("--workdir", help="Logs, keys and config (default: a temp dir).")
    ] = None,
    dp_peers: Annotated[int, typer.Option("--dp-peers", help="Fast peers per stage.")] = 1,
    anchor: Annotated[bool, typer.Option("--anchor/--no-anchor", help="Start an anchor peer.")] = True,
    cache_dir: CacheOpt = None,
) -> None:
    """Start a local swarm on 127.0.0.1 (bootstrap + one process per peer), train, report, stop everything."""
    with swarm_errors():
        from .node.demo import DEMO_METHODS, DemoOptions, run_demo

        if method not in DEMO_METHODS:
            raise ConfigError(f"--method: {method!r} is not one of {', '.join(DEMO_METHODS)}")

        opts = DemoOptions(
            tiny=tiny, steps=steps, method=method, config=config, overrides=list(set_ or []), metrics_out=metrics_out,
            workdir=workdir, dp_peers=dp_peers, anchor=anchor, cache_dir=cache_dir_from(cache_dir),
        )
        try:
            run_demo(opts)
        except KeyboardInterrupt:
            typer.secho("interrupted: every peer the demo started was stopped", err=True)
            raise typer.Exit(130) from None


# ---------------------------------------------------------------------------------------------
# data


@data_app.command("prepare")
def data_prepare(config: ConfigOpt, set_: SetOpt = None, cache_dir: CacheOpt = None) -> None:
    """Tokenise, split and pack the run's corpus into the cache (with a progress bar)."""
    from rich.progress import Progress

    with user_errors():
        cfg = load_config(config, list(set_ or []))
        from .data import make_tokenizer, prepare_corpus
        from .model import load_model

        cache = cache_dir_from(cache_dir)
        hf_tok = None
        if cfg.model.tokenizer == "model":
            _, hf_tok = load_model(cfg.model, cache)
        tok = make_tokenizer(cfg.model, hf_tok)
        with Progress() as progress:
            task = progress.add_task(f"tokenising {cfg.data.source}", total=None)

            def on_doc(done: int, total: int) -> None:
                progress.update(task, completed=done, total=total)

            corpus = prepare_corpus(cfg.data, tok, cache, on_doc)
    typer.echo(json.dumps({"directory": str(corpus.directory), **corpus.meta}, indent=1))


@data_app.command("fetch-linuxdoc")
def data_fetch_linuxdoc(cache_dir: CacheOpt = None) -> None:
    """Fetch Debian linux-doc-6.1 (apt-get download + dpkg -x) into the cache."""
    with user_errors():
        from .data import fetch_linuxdoc

        root = fetch_linuxdoc(cache_dir_from(cache_dir))
    typer.echo(f"linux-doc is in {root}")


def main() -> None:  # console-script entry point
    app(prog_name="meshnode")


if __name__ == "__main__":  # pragma: no cover
    main()
