"""The `syncrl` command: run, status, init-model.

Heavy libraries are imported only by the subcommands that need them, so `syncrl status` answers
in a fraction of a second.
"""

from __future__ import annotations

import argparse
import logging
import sys

from stages.common.config import ConfigError, load_config

log = logging.getLogger("syncrl")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="syncrl", description="Synchronous RL fine-tuning of LMs on SLURM.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="run (or resume) the RL job locally or inside an allocation")
    p.add_argument("config", help="YAML run config, e.g. configs/local_tiny.yaml")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. run_dir=runs/a iterations=2")
    p.add_argument("--launcher", choices=("auto", "local", "srun"), default="auto",
                   help="auto: srun steps inside a SLURM allocation, local processes elsewhere")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("status", help="iterations x stages table of a run directory")
    p.add_argument("run_dir")
    p.set_defaults(func=cmd_status)

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
    except FileNotFoundError as e:
        print(f"syncrl {args.command}: {e}", file=sys.stderr)
        return 2


def cmd_run(args) -> int:
    from jobs.coordinator import Coordinator, StageFailed, prepare_run, setup_coordinator_logging
    from jobs.launchers import make_launcher

    setup_coordinator_logging()
    cfg = load_config(args.config, args.overrides)
    prepare_run(cfg)
    launcher = make_launcher(args.launcher, cfg)
    log.info("launcher %s: %d task(s) per multi-rank stage on %s", launcher.name, launcher.ntasks("train"),
             ",".join(launcher.nodes()))
    try:
        Coordinator(cfg, launcher).run()
    except StageFailed as e:
        log.error("stopped: %s\nFix the cause, then rerun the same command: completed stages are kept.", e)
        return 1
    except KeyboardInterrupt:
        log.error("interrupted; rerun the same command to resume (completed stages are kept)")
        return 130
    return 0


def cmd_status(args) -> int:
    from jobs.status import format_table, stage_states

    print(format_table(stage_states(args.run_dir)))
    return 0


def cmd_init_model(args) -> int:
    from stages.common.tiny_model import create_base_model

    out = create_base_model(args.out_dir, args.preset, args.seed)
    print(f"wrote {args.preset} base model to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
