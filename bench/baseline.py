"""Run one benchmark on this tree and on the fixed baseline commit, alternately, in one
session: the comparison BENCHMARKS.md ("Baseline") asks of every change to the hot path, so
that a run of small steps, each "no slower than the tree before it", cannot add up to a large
regression unseen (issue 46: 1.67x plain Celery on the baseline became 1.15x over a few weeks).

The baseline is a detached worktree of :data:`BASELINE` under ``~/.cache/pipeline-bench`` with
its own virtualenv (``make venv`` there, once). Each round runs the benchmark script of each
tree with that tree's interpreter, this tree first, and prints the lines of its summary that
match ``--grep``; the benchmark's own ratios (against plain Celery, against the ceiling) are
measured within each run, so comparing them across the two trees compares like with like.

    .venv/bin/python bench/baseline.py -- bench/overhead.py --rounds 1          # ~8 min
    .venv/bin/python bench/baseline.py --rounds 3 --grep "ratio|median" -- bench/overhead.py
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

# The fixed baseline (2026-12-06): 1.667x plain Celery in bench/overhead.py, measured the day
# the regression of issue 46 was found. Change it only with a BENCHMARKS.md entry saying why.
BASELINE = "6788348"
ROOT = Path(__file__).resolve().parent.parent
CACHE = Path.home() / ".cache" / "pipeline-bench"


def baseline_tree(commit: str) -> Path:
    """A worktree of ``commit`` with its own virtualenv, made once."""
    tree = CACHE / f"baseline-{commit}"
    if not (tree / ".git").exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        git = ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit]
        subprocess.run(git, check=True)
    if not (tree / ".venv" / "bin" / "python").exists():
        subprocess.run(["make", "-C", str(tree), "venv"], check=True)
    return tree


def run(tree: Path, argv: list[str], pattern: re.Pattern[str]) -> int:
    """Run the benchmark in ``tree``; print its summary lines. Returns its exit code."""
    python = tree / ".venv" / "bin" / "python"
    proc = subprocess.run(
        [str(python), *argv], cwd=tree, capture_output=True, text=True, check=False
    )
    lines = [line for line in proc.stdout.splitlines() if pattern.search(line)]
    if not lines:  # nothing of its summary: show how it ended
        lines = ["(no summary line matched)", *(proc.stdout + proc.stderr).splitlines()[-8:]]
    for line in lines:
        print(f"    {line}", flush=True)
    if proc.returncode != 0:
        print(f"    exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    return proc.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    ap.add_argument("--commit", default=BASELINE, help=f"the baseline (default {BASELINE})")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two trees")
    ap.add_argument("--grep", default="ratio|median", help="summary lines to print (regex)")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- bench/SCRIPT.py [args]")
    args = ap.parse_args()
    argv = [a for a in args.bench if a != "--"][:]
    if not argv:
        ap.error("name the benchmark after --, e.g. -- bench/overhead.py --rounds 1")
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    trees = {f"this tree ({head})": ROOT, f"baseline ({args.commit})": baseline_tree(args.commit)}
    pattern = re.compile(args.grep)
    failed = 0
    for r in range(args.rounds):
        for name, tree in trees.items():
            print(f"round {r + 1}/{args.rounds}, {name}: {' '.join(argv)}", flush=True)
            failed |= run(tree, argv, pattern)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
