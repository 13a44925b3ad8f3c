"""The ``meshnode`` command line: thin typer commands over the library.

Domain errors (a bad config, a missing corpus, an unknown model) are printed as one line and exit
with code 1; no traceback reaches the user unless ``--debug`` is given. The environment is read here
only (``MESHNODE_CACHE``), never at import time elsewhere.
"""

from __future__ import annotations

import json
import logging
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


# ---------------------------------------------------------------------------------------------
# export


@app.command()
def export(
    out: Annotated[Path, typer.Option("--out", help="Hugging Face directory to write.")],
    checkpoint: Annotated[Path | None, typer.Option("--checkpoint", help="A checkpoint of meshnode train.")] = None,
) -> None:
    """Write a trained checkpoint as a plain Hugging Face model directory (untied lm_head)."""
    with user_errors():
        if checkpoint is None:
            raise ConfigError("export needs --checkpoint DIR")
        from .mesh import export_checkpoint

        path = export_checkpoint(checkpoint, out)
    typer.echo(f"wrote {path}")


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
