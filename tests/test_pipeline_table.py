"""The stage table (stages/runtime/pipeline.py) and the one upstream check the harness runs from it."""

from stages.runtime import markers, pipeline
from stages.runtime.paths import RunPaths
from stages.runtime.pipeline import PIPELINE, STAGES, Need


def test_the_table_is_consistent():
    assert STAGES == ("generate", "score", "gather", "train", "save", "persist")
    for s in PIPELINE:
        reads = {dep for dep, _ in s.reads}
        assert reads <= set(STAGES), s.name
        for need in s.needs:
            assert (need.stage, need.offset) in s.reads, (s.name, need)  # a need is also a fingerprinted input
            assert need.scope in ("rank", "ranks", "stage")
            # A need of one rank's output only makes sense between stages laid out alike.
            assert need.scope != "rank" or pipeline.stage(need.stage).every_rank == s.every_rank
        for e in s.starts_early:
            assert e.stage in STAGES and e.after in STAGES and e.ahead >= 0 and e.after_ahead >= 0
            # The marker it waits for comes before its turn: no early stage can overtake its input.
            assert (e.after_ahead, STAGES.index(e.after)) < (e.ahead, STAGES.index(e.stage)), e
        if s.done_before:
            # A background stage is joined before a later stage of a later iteration, never one it overlaps
            # on the critical path before it started; and nothing waits for its marker to start early.
            stage, ahead = s.done_before
            assert stage in STAGES and ahead >= 1, s
            assert not s.every_rank and not any(e.after == s.name for t in PIPELINE for e in t.starts_early)


def publish(paths, stage, rank, name, data, **extra):
    out = paths.stage_dir(0, stage) / name
    markers.write_bytes_atomic(out, data)
    markers.write_marker(paths, 0, stage, rank, attempt=1, start=0, config_hash="h", inputs="i",
                         outputs=markers.outputs_record([out], paths.root), extra=extra)
    return out


def test_need_problems_name_what_is_missing(tmp_path):
    paths = RunPaths(tmp_path)
    ranks = Need("score", "ranks")
    shards = [publish(paths, "score", r, f"rank_{r:05d}.jsonl", b"x" * 10) for r in (0, 2)]
    assert "rank(s) 1 are missing (expected 3 ranks)" in markers.need_problem(paths, 0, ranks, 0, 3)
    assert markers.need_problem(paths, 0, ranks, 0, 1) is None
    shards[0].write_bytes(b"x" * 4)
    assert "changed size (10 -> 4 bytes)" in markers.need_problem(paths, 0, ranks, 0, 1)
    assert "score.rank_00000.done" in markers.need_problem(paths, 0, ranks, 0, 1)
    assert "marker generate.rank_00001.done is missing" in markers.need_problem(paths, 0, Need("generate", "rank"),
                                                                              1, 2)
    # Outputs retention may delete (a checkpoint) do not make a marker stale, but a stage that reads them
    # needs them there.
    ckpt = publish(paths, "train", None, "ckpt.pt", b"w" * 8, prunable=["iter_00000/train/"])
    ckpt.unlink()
    marker = markers.read_marker(paths, 0, "train")
    assert markers.outputs_problem(paths, marker) is None
    assert "output iter_00000/train/ckpt.pt is missing" in markers.need_problem(paths, 0, Need("train", "stage"), 0, 1)
