"""The `syncrl` command: run, status, init-model.

Heavy libraries are imported only by the subcommands that need them, so `syncrl status` answers
in a fraction of a second.
"""

from __future__ import annotations

import argparse
import errno
import logging
import sys

from stages.runtime.config import ConfigError, load_config
from stages.runtime.paths import STAGES
from stages.runtime.pipeline import SERVICES

log = logging.getLogger("syncrl")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="syncrl", description="Synchronous RL fine-tuning of LMs on SLURM.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="run (or resume) the RL job locally or inside an allocation")
    _config_args(p)
    _launcher_arg(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("check", help="validate a config (keys, paths, DeepSpeed JSON, sizes, resources)")
    _config_args(p)
    _launcher_arg(p)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("status", help="iterations x stages table of a run directory")
    p.add_argument("run_dir")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("submit", help="submit the coordinator as a SLURM job through submitit (from a login node)")
    _config_args(p)
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("tail", help="per-rank logs of one stage, merged in time order")
    p.add_argument("run_dir")
    p.add_argument("--iteration", type=int, help="default: the latest stage that ran")
    p.add_argument("--stage", choices=STAGES + tuple(SERVICES), help="a stage, or the generation engines (engine)")
    p.add_argument("--attempt", type=int, help="default: the latest attempt")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--rank", type=int)
    who.add_argument("--node", help="node index or hostname")
    p.add_argument("-n", "--lines", type=int, help="only the last N lines (before following)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the stage stops running")
    p.set_defaults(func=cmd_tail)

    p = sub.add_parser("rerun", help="clear one stage's markers and run only it")
    p.add_argument("run_dir")
    p.add_argument("--iteration", type=int, required=True)
    p.add_argument("--stage", choices=STAGES, required=True)
    _launcher_arg(p)
    p.set_defaults(func=cmd_rerun)

    p = sub.add_parser("report", help="reward/accuracy and stage-time plots (PNG) plus a Markdown summary")
    p.add_argument("run_dir")
    p.add_argument("--out", help="directory for report.png and report.md (default: the run dir)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("init-model", help="write a built-in tiny base model (HF format) to a directory")
    p.add_argument("out_dir")
    p.add_argument("--preset", default="tiny-llama")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_init_model)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"syncrl {args.command}: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, FileExistsError) as e:
        print(f"syncrl {args.command}: {e}", file=sys.stderr)
        return 2
    except PermissionError as e:
        print(f"syncrl {args.command}: cannot {'read' if args.command in ('status', 'tail', 'report') else 'access'} "
              f"{e.filename}: permission denied; ask its owner for access, or run as a user who has it", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        from jobs.coordinator import describe_os_error

        print(f"syncrl {args.command}: {describe_os_error(e)}", file=sys.stderr)
        return 1


def _config_args(p) -> None:
    p.add_argument("config", help="YAML run config, e.g. configs/local_tiny.yaml")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. run_dir=runs/a iterations=2")


def _launcher_arg(p) -> None:
    p.add_argument("--launcher", choices=("auto", "local", "srun"), default="auto",
                   help="auto: srun steps inside a SLURM allocation, local processes elsewhere")


def cmd_check(args) -> int:
    from jobs.check import check_files

    problems, warnings = check_files(args.config, args.overrides, args.launcher)
    for w in warnings:
        print(f"syncrl check: warning: {w}", file=sys.stderr)
    for p in problems:
        print(f"syncrl check: {p}", file=sys.stderr)
    if not problems:
        print(f"syncrl check: {args.config}: no problems found")
    return 2 if problems else 0


def cmd_run(args) -> int:
    from jobs.coordinator import run, setup_coordinator_logging

    setup_coordinator_logging()
    return run(args.config, args.overrides, args.launcher)


def cmd_submit(args) -> int:
    from jobs.coordinator import checked_config, prepare_run, run_lock, setup_coordinator_logging
    from jobs.submit import print_submitted, submit

    setup_coordinator_logging()
    cfg = checked_config(args.config, args.overrides, "srun")
    lock = run_lock(cfg)  # held while the run dir is prepared; the submitted job takes its own
    try:
        prepare_run(cfg)
    finally:
        lock.release(force=True)
    print_submitted(submit(cfg), cfg.run_dir)
    return 0


def cmd_tail(args) -> int:
    from jobs.tail import tail

    try:
        tail(args.run_dir, args.iteration, args.stage, args.attempt, args.rank, args.node, args.follow, args.lines)
    except KeyboardInterrupt:
        pass
    return 0


def cmd_rerun(args) -> int:
    from jobs.coordinator import coordinate, setup_coordinator_logging
    from stages.runtime.paths import RunPaths

    setup_coordinator_logging()
    paths = RunPaths(args.run_dir)
    if not paths.config.is_file():
        raise FileNotFoundError(f"{paths.config} not found: {paths.root} is not a syncrl run directory")
    # The run acted on is the directory given, wherever it lives now: its config may record another
    # path (the run was copied or moved), which must not be touched.
    cfg = load_config(paths.config, [f"run_dir={paths.root.resolve()}"])
    if not 0 <= args.iteration < cfg.iterations:
        present = paths.iterations_present()
        raise ConfigError(f"--iteration {args.iteration}: this run has iterations 0-{cfg.iterations - 1} "
                          f"(iterations={cfg.iterations} in {paths.config}; started: "
                          f"{', '.join(map(str, present)) or 'none'}); to add iterations, syncrl run it with "
                          f"iterations=N")
    return coordinate(cfg, args.launcher, lambda c: c.rerun(args.iteration, args.stage))


def cmd_status(args) -> int:
    from jobs.status import format_table, stage_states

    print(format_table(stage_states(args.run_dir)))
    return 0


def cmd_report(args) -> int:
    from jobs.report import write_report

    png, md = write_report(args.run_dir, args.out)
    print(f"wrote {png} and {md}")
    return 0


def cmd_init_model(args) -> int:
    from jobs.base_model import create_base_model

    out = create_base_model(args.out_dir, args.preset, args.seed)
    print(f"wrote {args.preset} base model to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
