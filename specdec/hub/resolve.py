"""Turn a preset name, HF directory or GGUF file into a local HF-style model directory.

Cache layout under `cache_root()`:
    gguf/<preset gguf_name>      assembled, checksum-verified GGUF: the weights
    models/<preset name>/        config, tokenizer and a pointer to the GGUF (no weights)
    converted/<stem>-<key>/      the same for a user's GGUF file
    kernels/                     the compiled CPU kernels (specdec/cpu_kernels/build.py)
    locks/<name>.lock            serialises concurrent pulls of the same thing
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
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


def _current(out_dir: Path) -> bool:
    """A finished conversion of the current layout. One from before weights stayed in the GGUF
    (float32 safetensors, 4-8x the file) is removed, so that upgrading frees its disk."""
    if not out_dir.is_dir():
        return False
    src = out_dir / "specdec_source.json"
    if src.is_file() and json.loads(src.read_text()).get("weights") == "gguf":
        return True
    shutil.rmtree(out_dir)
    return False


def pull(name: str, progress: bool = True) -> Path:
    """Install a preset (download, assemble, verify sha256, prepare); instant when cached."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    preset = PRESETS[name]
    out_dir = cache_root() / "models" / name
    if (out_dir / "specdec_source.json").is_file() and _current(out_dir):
        return out_dir
    with _lock(name):
        if _current(out_dir):
            return out_dir
        gguf = cache_root() / "gguf" / preset.gguf_name
        if not gguf.is_file():
            fetch.fetch_gguf(preset, gguf, progress)
        return convert.convert_gguf(gguf, out_dir, progress)


def check_hf_dir(path: Path) -> Path:
    """Return `path` if it has config, weights (safetensors, or a GGUF it points to) and a
    tokenizer; else say what it lacks."""
    missing: list[str] = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    index = path / "model.safetensors.index.json"
    src = path / "specdec_source.json"
    if src.is_file() and json.loads(src.read_text()).get("weights") == "gguf":
        gguf = Path(json.loads(src.read_text())["gguf"])
        if not gguf.is_file():
            missing.append(f"the GGUF file it takes its weights from ({gguf})")
    elif index.is_file():
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
        if (out_dir / "specdec_source.json").is_file() and _current(out_dir):
            return out_dir
        with _lock(out_dir.name):
            if _current(out_dir):
                return out_dir
            return convert.convert_gguf(path, out_dir, progress)
    if path.suffix.lower() == ".gguf":
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    raise ValueError(_usage(name_or_path))
