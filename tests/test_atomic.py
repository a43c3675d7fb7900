import math

from mechdiag import atomic
from mechdiag.run import RunDir


def test_partial_last_line_dropped(tmp_path):
    p = tmp_path / "m.jsonl"
    atomic.append_jsonl(p, [{"step": 1, "x": 1.0}, {"step": 2, "x": math.nan}])
    with open(p, "a") as f:
        f.write('{"step": 3, "x"')  # a crash mid-write
    recs = atomic.read_jsonl(p)
    assert recs == [{"step": 1, "x": 1.0}, {"step": 2, "x": None}]


def test_atomic_write_leaves_nothing_on_error(tmp_path):
    target = tmp_path / "out.json"
    try:
        with atomic.atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def test_rundir_drop_after(tmp_path):
    run = RunDir(tmp_path / "r", create=True)
    run.append("metrics", [{"step": s, "reward": s * 0.1} for s in range(1, 6)])
    run.drop_after(3)
    assert [r["step"] for r in run.read("metrics")] == [1, 2, 3]
