import json
import os

import pytest

from stages.runtime import markers
from stages.runtime.paths import RunPaths


@pytest.fixture
def paths(tmp_path):
    return RunPaths(tmp_path / "run")


def publish_shard(paths, it, stage, rank, text="x\n"):
    p = paths.shard(it, stage, rank)
    markers.write_text_atomic(p, text)
    return markers.write_marker(paths, it, stage, rank, attempt=1, start=0.0, config_hash="h", inputs="i",
                                outputs=markers.outputs_record([p], paths.root))


def test_atomic_write_leaves_no_temp(paths):
    p = paths.root / "a" / "b.json"
    markers.write_json_atomic(p, {"k": 1})
    assert json.loads(p.read_text()) == {"k": 1}
    assert os.listdir(p.parent) == ["b.json"]


def test_marker_round_trip_and_listing(paths):
    publish_shard(paths, 3, "generate", 0)
    publish_shard(paths, 3, "generate", 2)
    m = markers.read_marker(paths, 3, "generate", 2)
    assert m["rank"] == 2 and m["iteration"] == 3 and m["attempt"] == 1
    rel = "iter_00003/generate/rank_00002.jsonl"
    assert m["outputs"][rel]["size"] == 2 and len(m["outputs"][rel]["sha256"]) == 64
    assert markers.rank_markers_present(paths, 3, "generate") == {0, 2}
    assert markers.rank_markers_present(paths, 3, "score") == set()


def test_marker_problem_cases(paths):
    m = publish_shard(paths, 0, "score", 1, "abc\n")
    assert markers.marker_problem(paths, m, "h", "i") is None
    assert markers.marker_problem(paths, None, "h", "i") == "no marker"
    assert markers.marker_problem(paths, m, "other", "i") == "config changed"
    assert "inputs changed" in markers.marker_problem(paths, m, "h", "j")
    paths.shard(0, "score", 1).write_text("abcdef\n")
    assert "changed size" in markers.marker_problem(paths, m, "h", "i")
    paths.shard(0, "score", 1).unlink()
    assert "missing" in markers.marker_problem(paths, m, "h", "i")
    m["prunable"] = ["iter_00000/score/"]
    assert markers.marker_problem(paths, m, "h", "i") is None  # removed by retention is fine


def test_corrupt_marker_counts_as_not_done(paths):
    d = paths.markers(0)
    d.mkdir(parents=True)
    (d / "gather.done").write_text("{half")
    assert markers.read_marker(paths, 0, "gather") is None


def test_fingerprint_follows_upstream_outputs(paths):
    base = markers.input_fingerprint(paths, 0, "score", "preset:x")
    publish_shard(paths, 0, "generate", 0, "one\n")
    m = markers.read_marker(paths, 0, "generate", 0)
    markers.write_marker(paths, 0, "generate", None, attempt=1, start=0, config_hash="h", inputs="i",
                         outputs=m["outputs"])
    fp1 = markers.input_fingerprint(paths, 0, "score", "preset:x")
    assert fp1 != base
    publish_shard(paths, 0, "generate", 0, "two!\n")
    m = markers.read_marker(paths, 0, "generate", 0)
    markers.write_marker(paths, 0, "generate", None, attempt=2, start=0, config_hash="h", inputs="i",
                         outputs=m["outputs"])
    assert markers.input_fingerprint(paths, 0, "score", "preset:x") != fp1
    # iteration 0's generate depends only on the base model
    assert markers.input_fingerprint(paths, 0, "generate", "a") != markers.input_fingerprint(paths, 0, "generate", "b")


def test_clear_stage(paths):
    publish_shard(paths, 1, "score", 0)
    publish_shard(paths, 1, "score", 1)
    markers.write_marker(paths, 1, "score", None, attempt=1, start=0, config_hash="h", inputs="i", outputs={})
    markers.clear_stage(paths, 1, "score")
    assert markers.read_marker(paths, 1, "score") is None
    assert markers.rank_markers_present(paths, 1, "score") == set()


def test_jsonl_round_trip_and_truncation(paths):
    p = paths.root / "x.jsonl"
    assert markers.write_jsonl_atomic(p, ({"i": i} for i in range(3))) == 3
    assert markers.read_jsonl(p) == [{"i": 0}, {"i": 1}, {"i": 2}]
    p.write_text(p.read_text()[:-3])
    with pytest.raises(ValueError, match="truncated"):
        markers.read_jsonl(p)


def test_attempt_numbering(paths):
    assert paths.attempts_so_far(0, "train") == 0
    paths.logs(0, "train", 1).mkdir(parents=True)
    paths.logs(0, "train", 2).mkdir(parents=True)
    assert paths.attempts_so_far(0, "train") == 2
    assert paths.rank_log(0, "train", 2, 1).name == "rank_00001.log"


def test_an_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path):
    """SIGTERM unwinds the coordinator as KeyboardInterrupt, possibly mid-write."""
    from stages.runtime.markers import write_json_atomic, write_jsonl_atomic

    target = tmp_path / "state.json"
    write_json_atomic(target, {"state": "running"})

    def rows():
        yield {"a": 1}
        raise KeyboardInterrupt("signal 15")

    with pytest.raises(KeyboardInterrupt):
        write_jsonl_atomic(tmp_path / "rows.jsonl", rows())
    assert json.loads(target.read_text()) == {"state": "running"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_killed_writer_leaves_a_temporary_that_the_next_attempt_removes(tmp_path):
    """SIGKILL cannot be unwound: srun's --kill-on-bad-exit may end a rank mid-write of its failure
    record. The coordinator removes that stage's temporaries before its next attempt, no one else's."""
    from stages.runtime.markers import remove_partial_writes
    from stages.runtime.paths import RunPaths

    paths = RunPaths(tmp_path)
    paths.markers(0).mkdir(parents=True)
    mine = paths.markers(0) / ".persist.rank_00000.failed.tmp.4184"
    other = paths.markers(0) / ".train.rank_00001.done.tmp.77"
    done = paths.markers(0) / "persist.rank_00001.done"
    for p in (mine, other, done):
        p.write_text("{")
    assert remove_partial_writes(paths, 0, "persist") == [mine]
    assert not mine.exists() and other.exists() and done.exists()
    assert remove_partial_writes(paths, 1, "persist") == []  # no markers folder yet
