"""HumanEval-Infilling tasks and their scoring (the construction of Bavarian et al. 2022,
"Efficient Training of Language Models to Fill in the Middle"), for bench/fim_eval.py: a
"single" task masks one non-blank line of a problem's canonical solution, a "multi" task a block
of 2+ consecutive lines; the prefix is the prompt and the lines before, the suffix the lines
after. A completion passes when prefix + completion + suffix + the tests exits 0 in its own
Python process (`run_program`: this runs model-written code, in a temp directory, its own
process group, under a memory limit and a timeout)."""

from __future__ import annotations

import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Task:
    id: str
    problem: str
    mode: str  # "single" | "multi"
    first_line: int  # masked solution lines, inclusive, 0-based within canonical_solution
    last_line: int
    prefix: str
    middle: str
    suffix: str


def build_tasks(problems: dict[str, dict[str, Any]], mode: str, limit: int, seed: int,
                pick: str) -> list[Task]:
    """One task per problem, for `limit` problems in file order (the first ones, or spread evenly
    over the eligible ones). The line choice depends only on seed, mode and problem, so a task
    is the same whatever `limit` and `pick` are."""
    eligible = []
    for tid, prob in problems.items():
        lines = prob["canonical_solution"].splitlines(keepends=True)
        if sum(1 for line in lines if line.strip()) >= (2 if mode == "multi" else 1):
            eligible.append(tid)
    if limit < len(eligible):
        eligible = (eligible[:limit] if pick == "first"
                    else [eligible[k * len(eligible) // limit] for k in range(limit)])
    tasks = []
    for tid in eligible:
        prob = problems[tid]
        lines = prob["canonical_solution"].splitlines(keepends=True)
        nonblank = [i for i, line in enumerate(lines) if line.strip()]
        rng = random.Random(f"{seed}/{mode}/{tid}")
        if mode == "single":
            first = last = rng.choice(nonblank)
        else:
            first, last = rng.choice([(i, j) for n, i in enumerate(nonblank)
                                      for j in nonblank[n + 1:]])
        span = f"L{first}" if first == last else f"L{first}-{last}"
        tasks.append(Task(id=f"{mode}/{tid}/{span}", problem=tid, mode=mode, first_line=first,
                          last_line=last, prefix=prob["prompt"] + "".join(lines[:first]),
                          middle="".join(lines[first:last + 1]),
                          suffix="".join(lines[last + 1:])))
    return tasks


def program(task: Task, prob: dict[str, Any], middle: str) -> str:
    return (task.prefix + middle + task.suffix + "\n" + prob["test"]
            + f"\ncheck({prob['entry_point']})\n")


def trim(task: Task, completion: str) -> str:
    """The completion cut where an editor would cut it, for the secondary `trimmed` scores: a
    single-line task keeps its first non-blank line; a multi-line one stops before the first
    line that repeats the suffix's first non-blank line or starts at column 0 (every HumanEval
    solution line is indented, so such a line has left the function body)."""
    lines = completion.splitlines(keepends=True)
    if task.mode == "single":
        for k, line in enumerate(lines):
            if line.strip():
                return "".join(lines[:k + 1])
        return completion
    echo = next((line.strip() for line in task.suffix.splitlines() if line.strip()), None)
    for k, line in enumerate(lines):
        if line.strip() and (line.strip() == echo or not line[0].isspace()):
            return "".join(lines[:k])
    return completion


def _limit_child() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def run_program(src: str, timeout: float) -> tuple[bool, str]:
    """Run `src` with this interpreter in a fresh temp directory and its own process group;
    passed means exit code 0 within `timeout` seconds. Returns (passed, short reason)."""
    with tempfile.TemporaryDirectory(prefix="fim_eval_") as d:
        path = Path(d) / "candidate.py"
        path.write_text(src)
        proc = subprocess.Popen([sys.executable, "-I", str(path)], cwd=d,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=_limit_child,
                                env={"PATH": os.environ.get("PATH", ""), "HOME": d})
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()
            return False, f"timeout after {timeout:.0f} s"
        if proc.returncode == 0:
            return True, "passed"
        tail = err.decode(errors="replace").strip().splitlines()
        return False, (tail[-1] if tail else f"exit {proc.returncode}")[:200]
