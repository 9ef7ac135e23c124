"""The pipeline, declared once: the stages of an iteration in order, and for each what it reads, how
its processes are laid out and what may start early beside it. Torch-free.

The coordinator, the launchers, the input fingerprints, status, report, tail and the stage harness's
upstream check all read this table. A new stage is one entry here and one module in stages/.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Need:
    """Outputs a stage must find before it works: `stage`'s of iteration I + `offset`, as recorded by
    that stage's marker of the same rank ("rank"), the markers of all its ranks ("ranks"), or the
    stage-level marker the coordinator writes once every rank is done ("stage")."""
    stage: str
    scope: str  # "rank" | "ranks" | "stage"
    offset: int = 0


@dataclass(frozen=True)
class EarlyStart:
    """When the key stage starts, start `stage` of iteration I + `ahead` early; it loads, then waits
    for the marker of `after` of iteration I + `after_ahead` before it reads anything."""
    ahead: int
    stage: str
    after: str
    after_ahead: int


@dataclass(frozen=True)
class Stage:
    name: str
    every_rank: bool  # one process per rank; otherwise one task
    # (stage, offset): what this stage of iteration I reads, for its input fingerprint (a marker of
    # an upstream stage that is redone makes this one stale).
    reads: tuple[tuple[str, int], ...]
    needs: tuple[Need, ...] = ()
    # One task per generate.gpus_per_process GPUs (score scores generate's shards one to one).
    grouped: bool = False
    starts_early: tuple[EarlyStart, ...] = ()
    every_node: bool = False  # one task per node (for node-local files)
    # Runs on the accelerators: the processes of stages before it that wrote their markers but had
    # not yet exited (and so may still hold GPU memory) are waited for before it starts.
    gpu: bool = False
    # Started early, it sets up on the GPUs (process group, models, resumed state) as soon as the
    # coordinator notes them free (markers.gpus_free_path), while the light stages before its turn run.
    sets_up_early: bool = False
    # A background stage starts at its turn and runs beside the stages after it; it must be done
    # before `done_before` = (stage, ahead) of iteration I + ahead starts, and before the run ends.
    done_before: tuple[str, int] | None = None


# Persist copies train's node-local checkpoint (train.local_checkpoint_dir) to the run dir beside
# the next iteration's generate, score and gather; the next train, which replaces the node-local
# copy, waits for it.
# Score and gather start at their turns: started early they end sooner, but train's set-up, which
# begins as generate's processes exit, outlasts them, so their turn only comes sooner for train to
# wait in (docs/benchmarks.md: score and gather started early, tried and reverted). Train starts one whole
# iteration ahead, with the generate before its own (in iteration 0, trains 0 and 1 start at generate
# 0): on the GPU machines' hosts its imports outlasted the train, save, generate, score and gather it
# had when it started with the previous train, and its turn waited for them (docs/benchmarks.md;
# started at save, they outlasted the light stages). Once generate's processes have exited it builds its
# engine and resumes while score and gather run (sets_up_early), and only reads the train set at its turn.
# Save starts with generate: started with train, its imports competed with the next generate's and
# train's and ran past its turn. The next generate starts with this generate, for the same reason:
# started with train, its imports shared the host with the next train's and the update.
PIPELINE = (
    Stage("generate", every_rank=True, grouped=True, gpu=True, reads=(("save", -1),),
          starts_early=(EarlyStart(0, "train", "gather", 0), EarlyStart(1, "train", "gather", 1),
                        EarlyStart(0, "save", "train", 0), EarlyStart(1, "generate", "save", 0))),
    Stage("score", every_rank=True, grouped=True, reads=(("generate", 0),), needs=(Need("generate", "rank"),)),
    Stage("gather", every_rank=False, reads=(("score", 0),), needs=(Need("score", "ranks"),)),
    Stage("train", every_rank=True, gpu=True, sets_up_early=True, reads=(("gather", 0), ("save", -1)),
          needs=(Need("gather", "stage"),)),
    Stage("save", every_rank=False, reads=(("train", 0),), needs=(Need("train", "stage"),)),
    Stage("persist", every_rank=False, every_node=True, reads=(("train", 0),), needs=(Need("train", "stage"),),
          done_before=("train", 1)),
)

BY_NAME = {s.name: s for s in PIPELINE}
STAGES = tuple(s.name for s in PIPELINE)
# Stages that run one process per rank; the others run as a single task.
MULTI_RANK_STAGES = tuple(s.name for s in PIPELINE if s.every_rank)
# Stages that run one task per node.
PER_NODE_STAGES = tuple(s.name for s in PIPELINE if s.every_node)
# Stages that run beside the others (their wall time overlaps theirs: not summed into an iteration's).
BACKGROUND_STAGES = tuple(s.name for s in PIPELINE if s.done_before)


# Services: long-lived steps beside the stages, with no markers of their own, each laid out like
# the stage it serves. The engine (stages/engine.py, generate.persistent) samples for generate.
SERVICES = {"engine": "generate"}


def stage(name: str) -> Stage:
    return BY_NAME[name]


def layout(name: str) -> Stage:
    """The stage whose process layout `name` (a stage or a service) has."""
    return BY_NAME[SERVICES.get(name, name)]


def group_size(name: str, generate_group: int) -> int:
    """Ranks one task of `name` stands for: generate.gpus_per_process for the grouped stages, else 1."""
    return generate_group if layout(name).grouped else 1
