"""Turn a preset name, HF directory or GGUF file into a local HF-style model directory.

Cache layout under `cache_root()`:
    gguf/<preset gguf_name>      assembled, checksum-verified GGUF (kept: see `pull`)
    models/<preset name>/        converted HF directory of a preset
    converted/<stem>-<key>/      converted HF directory of a user GGUF file
    locks/<name>.lock            serialises concurrent pulls of the same thing
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from specdec.hub import convert, fetch
from specdec.hub.presets import PRESETS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def cache_root() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE") or "~/.cache/specdec").expanduser()


@contextmanager
def _lock(name: str) -> Iterator[None]:
    # Two engines started at once must not both download 1 GB and race on the rename.
    lock_dir = cache_root() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def default_draft_for(name_or_path: str) -> str | None:
    """The preset name of the draft model that pairs with a preset target, else None."""
    preset = PRESETS.get(name_or_path)
    return preset.draft if preset is not None else None


def pull(name: str, progress: bool = True) -> Path:
    """Install a preset (download, assemble, verify sha256, convert); instant when cached.

    The assembled GGUF is kept for every preset: it is 4-8x smaller than the float32 directory,
    so keeping it is cheap, and it lets a reconversion (e.g. after a transformers upgrade) skip
    the download.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    preset = PRESETS[name]
    out_dir = cache_root() / "models" / name
    if out_dir.is_dir():
        return out_dir
    with _lock(name):
        if out_dir.is_dir():
            return out_dir
        gguf = cache_root() / "gguf" / preset.gguf_name
        if not gguf.is_file():
            fetch.fetch_gguf(preset, gguf, progress)
        return convert.convert_gguf(gguf, out_dir, progress)


def check_hf_dir(path: Path) -> Path:
    """Return `path` if it has config, safetensors weights and a tokenizer; else say what lacks."""
    missing: list[str] = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing += [f"{s} (listed in {index.name})" for s in shards if not (path / s).is_file()]
    elif not any(path.glob("*.safetensors")):
        missing.append("*.safetensors weights (or model.safetensors.index.json with its shards)")
    has_tokenizer = (path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file() or (
        (path / "vocab.json").is_file() and (path / "merges.txt").is_file()
    )
    if not has_tokenizer:
        missing.append("tokenizer files (tokenizer.json, tokenizer.model or vocab.json+merges.txt)")
    if missing:
        raise FileNotFoundError(f"model directory {path} is missing: {'; '.join(missing)}")
    return path


def _gguf_cache_dir(gguf: Path) -> Path:
    # Keyed by path+size+mtime rather than a content hash: hashing a multi-GB file on every
    # start would cost seconds, and an edited file changes size or mtime anyway.
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "converted" / f"{gguf.stem}-{key}"


def _usage(name_or_path: str) -> str:
    return (
        f"cannot resolve model {name_or_path!r}: expected a preset name "
        f"({', '.join(sorted(PRESETS))}), a directory with config.json, *.safetensors and "
        f"tokenizer files, or a path to a .gguf file"
    )


def resolve_model_path(name_or_path: str, progress: bool = True) -> Path:
    """Return a local HF-style directory for a preset name, an HF directory or a .gguf file."""
    if name_or_path in PRESETS and not Path(name_or_path).exists():
        return pull(name_or_path, progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return check_hf_dir(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        path = path.resolve()
        out_dir = _gguf_cache_dir(path)
        if out_dir.is_dir():
            return out_dir
        with _lock(out_dir.name):
            if out_dir.is_dir():
                return out_dir
            return convert.convert_gguf(path, out_dir, progress)
    if path.suffix.lower() == ".gguf":
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    raise ValueError(_usage(name_or_path))
