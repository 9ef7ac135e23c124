"""Before and after on one machine: one benchmark command run in several source trees, in turn.

A speed change is judged against the code before it measured on the same machine in the same session
(GPUs of one model differ by several percent from machine to machine, and a cold cache costs the
first run). This runs COMMAND once per tree per round, in the tree's own directory with that tree
first on PYTHONPATH, the trees' order reversed every other round (so neither always runs first), keeps
each run's output, and prints, for each run, its seconds, its exit status and the lines of its output
that match --grep.

    # on the machine with the git history: a tree per revision (git archive, no .git needed later)
    python tests/benchmarks/compare_trees.py archive --out /tmp/trees before=main~3 after=main
    # where the benchmark runs ({tree}: the tree's directory, {name}: its name, {round}: the round)
    python tests/benchmarks/compare_trees.py run --trees /tmp/trees/before /tmp/trees/after --rounds 2 \\
        --logs /tmp/cmp --grep 'iteration|new tok/s' -- \\
        python3 tests/benchmarks/gpu_pipeline.py --run-dir /tmp/cmp/run_{name}_{round} ranks=1

A run that exceeds --timeout is stopped (its whole process group) and reported as such; the rounds go on.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def archive(out: Path, specs: list[str]) -> list[Path]:
    """NAME=REVISION -> OUT/NAME holding that revision's files (replaced if it exists)."""
    trees = []
    for spec in specs:
        name, sep, rev = spec.partition("=")
        if not sep or not name or not rev or "/" in name:
            raise SystemExit(f"compare_trees archive: {spec!r} is not NAME=REVISION (e.g. before=main~1)")
        tree = out / name
        shutil.rmtree(tree, ignore_errors=True)
        tree.mkdir(parents=True)
        git = subprocess.Popen(["git", "-C", str(ROOT), "archive", rev], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(tree)], stdin=git.stdout, check=True)
        if git.wait() != 0:
            raise SystemExit(f"compare_trees archive: git archive {rev} failed (is {rev!r} a revision here?)")
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], capture_output=True,
                             text=True, check=True).stdout.strip()
        (tree / ".revision").write_text(f"{rev} {sha}\n")
        print(f"{name}: {rev} ({sha}) in {tree}")
        trees.append(tree)
    return trees


def run_one(tree: Path, name: str, rnd: int, command: list[str], log: Path, timeout: float) -> dict:
    """COMMAND in TREE, its output into LOG; returns seconds, exit status and whether it timed out."""
    argv = [part.format(tree=tree, name=name, round=rnd) for part in command]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
    t0 = time.time()
    with open(log, "wb") as out:
        out.write(f"$ (cd {tree} && {' '.join(argv)})\n".encode())
        out.flush()
        proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            # The benchmark's own children (a pipeline's stage processes) go with it.
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
    return {"seconds": time.time() - t0, "code": code, "timed_out": timed_out}


def matching_lines(log: Path, pattern: re.Pattern, last: int) -> list[str]:
    lines = [line.rstrip() for line in log.read_text(errors="replace").splitlines()[1:] if pattern.search(line)]
    return lines[-last:] if last else lines


def run_all(trees: list[Path], rounds: int, logs: Path, command: list[str], grep: str, last: int,
            timeout: float) -> list[dict]:
    names = [tree.name for tree in trees]
    if len(set(names)) != len(names):
        raise SystemExit(f"compare_trees run: trees need distinct directory names (got {names})")
    missing = [str(tree) for tree in trees if not tree.is_dir()]
    if missing:
        raise SystemExit(f"compare_trees run: no such tree: {', '.join(missing)} (make them with `archive`)")
    logs.mkdir(parents=True, exist_ok=True)
    pattern = re.compile(grep)
    runs = []
    for rnd in range(rounds):
        for tree in (trees if rnd % 2 == 0 else trees[::-1]):
            log = logs / f"{tree.name}_round{rnd}.log"
            result = run_one(tree, tree.name, rnd, command, log, timeout)
            result.update(tree=tree.name, round=rnd, log=log, lines=matching_lines(log, pattern, last))
            runs.append(result)
            print(report_run(result), flush=True)
    return runs


def report_run(run: dict) -> str:
    status = "timed out" if run["timed_out"] else f"exit {run['code']}"
    head = f"## {run['tree']}, round {run['round']}: {run['seconds']:.1f}s, {status} ({run['log']})"
    return "\n".join([head, *(f"    {line}" for line in run["lines"])])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("archive", help="a tree per NAME=REVISION, from this repository's history")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("specs", nargs="+", metavar="NAME=REVISION")
    p = sub.add_parser("run", help="run one command in each tree, in turn")
    p.add_argument("--trees", type=Path, nargs="+", required=True)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--logs", type=Path, required=True, help="each run's output: LOGS/NAME_roundR.log")
    p.add_argument("--grep", default=".", help="regular expression: the output lines to print per run")
    p.add_argument("--last", type=int, default=40, help="print at most the last N matching lines (0: all)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds a run may take")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ({tree}, {name}, {round} substituted)")
    args = parser.parse_args(argv)
    if args.command == "archive":
        archive(args.out, args.specs)
        return 0
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        parser.error("run: give the command after --")
    if args.rounds < 1 or args.timeout <= 0:
        parser.error("run: --rounds must be >= 1 and --timeout > 0")
    runs = run_all(args.trees, args.rounds, args.logs, command, args.grep, args.last, args.timeout)
    return 0 if all(r["code"] == 0 and not r["timed_out"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
