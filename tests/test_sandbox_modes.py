"""The sandbox where users run (issue 27): `sandbox: landlock`, the mode for containers without user namespaces,
against the hostile corpus as root and as an unprivileged user (bubblewrap too, as that user); the trainer with
code rewards under it; fairness: a candidate's deadline is its own CPU time, so neither a busy neighbour in the
batch nor hogs outside change a verdict."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mechdiag import sandbox
from mechdiag import sandbox_landlock as landlock
from mechdiag.run import RunDir
from tests.sandbox_conditions import USER, as_user, env_without_bwrap, without_landlock
from tests.test_sandbox import (
    BEFORE_40,
    CORPUS,
    GOLD_LOAD,
    GOLD_TIMEOUT,
    OS_FAMILIES,
    SLACK,
    WALL,
    _gold_jobs,
    corpus_figures,
)
from tests.test_sandbox_verdicts import guard_only_runs

ROOT = Path(__file__).resolve().parent.parent


def test_this_kernel_has_landlock_and_the_mode_starts():
    # Linux 6.18 here, landlock ABI 7: signals are scoped (ABI 6), so the mode also holds as a user
    assert landlock.abi() >= landlock.SIGNAL_SCOPE_ABI
    assert sandbox._reason("landlock") is None
    p = subprocess.run(without_landlock(["-c", "from mechdiag import sandbox_landlock as l\n"
                                         "print(l.abi(), l.refusal(l.abi(), True))"]),
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    assert p.stdout.split(None, 1) == ["0", landlock.refusal(0, True) + "\n"] and "no landlock" in p.stdout


def _contained(fig: dict, n: int) -> None:
    assert fig["wrong"] == [] and fig["host_dead"] == [] and fig["leaks"] == [] and fig["intact"], fig
    assert fig["left_behind"] == [] and fig["contained"] == fig["tried"] == n, fig
    assert fig["worst_wall_s"] <= WALL + SLACK, {k: (r["duration_s"], r["waited_s"]) for k, r in fig["by"].items()}


def test_landlock_contains_the_corpus_as_root(tmp_path):
    # (issue 40's cases: through the trainer's path per mode, tests/test_sandbox.py)
    fig = corpus_figures(tmp_path, BEFORE_40, iso="landlock")
    _contained(fig, len(BEFORE_40))
    by = fig["by"]
    assert all(r["isolation"] == "landlock" for r in by.values())
    assert by["infinite_loop"]["status"] == "timeout" and by["sleep_forever"]["status"] == "timeout"
    assert by["huge_output"]["status"] == "output_limit" and by["wrong_answer"]["status"] == "failed"
    # its private folder is held to TMP_BYTES: by the kernel (its own tmpfs, as root with CAP_SYS_ADMIN: the
    # writes fail with ENOSPC), else by the host (the run is stopped: disk_limit)
    assert by["disk_many_files"]["status"] == ("failed" if sandbox._own_mounts() else "disk_limit")
    for n in ("subinterp_bypass", "testcapi_subinterp", "fork_bomb", "kill_host"):  # seen, left to the OS layer
        assert by[n]["blocked"] and "not allowed" not in by[n]["detail"], (n, by[n])


def test_landlock_os_layer_alone_contains_the_escapes_as_root(tmp_path):
    # guard off: the uid, landlock, seccomp and rlimits alone
    names = [n for n in CORPUS if n in OS_FAMILIES]
    _contained(corpus_figures(tmp_path, names, guard=False, iso="landlock"), len(names))


USER_CORPUS = """
import json, os, sys
from pathlib import Path
from tests.test_sandbox import CORPUS, OS_FAMILIES, corpus_figures
names = [n for n in CORPUS if n in OS_FAMILIES]
fig = corpus_figures(Path(sys.argv[1]), names, guard=False, iso=sys.argv[2])
fig["by"] = {n: {k: v for k, v in r.items() if k != "detail"} for n, r in fig["by"].items()}
print(os.getuid(), json.dumps(fig))
"""


def test_as_a_user_bwrap_and_landlock_contain_the_escapes():
    # an unprivileged user (uid 65534; setpriv from root here) with the guard off: the user's own files (outside,
    # owned by that user) stay intact, the user's host processes live
    names = [n for n in CORPUS if n in OS_FAMILIES]
    for iso in ("bwrap", "landlock"):
        outside = Path(tempfile.mkdtemp(prefix="mechdiag-user-outside-"))  # pytest's tmp_path is root's, 0700
        try:
            os.chown(outside, USER, USER)
            cmd = as_user(USER_CORPUS)
            assert cmd is not None  # this machine runs the suite as root with setpriv and a system Python
            p = subprocess.run(cmd + [str(outside), iso], capture_output=True, text=True, timeout=600, cwd="/tmp")
            assert p.returncode == 0, p.stderr[-2000:]
            uid, text = p.stdout.strip().splitlines()[-1].split(" ", 1)
        finally:
            shutil.rmtree(outside, ignore_errors=True)
        fig = json.loads(text)
        assert uid == str(USER) and {r["isolation"] for r in fig["by"].values()} == {iso}
        _contained(fig, len(names))


PRIVS = ("import ctypes, os\ndef f():\n    libc = ctypes.CDLL(None, use_errno=True)\n"
         "    hdr, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()\n"
         "    libc.capget(hdr, data)\n    try:\n        open('/etc/hostname').close()\n        fs = 'open'\n"
         "    except OSError as e:\n        fs = e.errno\n"
         "    return [os.getuid(), data[0], data[3], libc.prctl(39, 0, 0, 0, 0), libc.prctl(21, 0, 0, 0, 0), fs,\n"
         "            sorted(os.sched_getaffinity(0))]\n")


def test_landlock_candidate_runs_unprivileged_and_confined():
    # guard off: a uid of its own (never 0), no capability (CAP_DAC_READ_SEARCH alone where the interpreter sits
    # in a folder only root enters, as /root/.pyenv here), no_new_privs, seccomp filter mode, landlock (EACCES
    # on a file no rule allows), pinned to its one core
    cpu = sandbox.cores()[-1]
    r = sandbox._run(PRIVS, "print(f())\nassert False\n", 5, 256, 16, 8, sandbox.MAX_OUTPUT, 10, (), "landlock",
                     guard=False, cpu=cpu)
    uid, eff, eff_hi, nnp, seccomp_mode, fs, affinity = eval(r.detail.strip().splitlines()[0])
    needs_cap = landlock.needs_read_cap(landlock.system_paths(sandbox._prefixes(), sandbox.PROGRAMS)[0])
    assert uid != 0 and eff == (1 << landlock.CAP_DAC_READ_SEARCH if needs_cap else 0) and eff_hi == 0, r.detail
    assert nnp == 1 and seccomp_mode == 2 and fs == 13 and affinity == [cpu]


def test_trainer_with_code_rewards_under_landlock(stories260k, tmp_path):
    # no bwrap on PATH (a container without user namespaces looks the same to mechdiag): auto takes landlock,
    # says so once, records it; half the programs try to kill the trainer, which lives and pays them 0
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "mechdiag", "train", "--set", f"model.name_or_path={stories260k}",
                        "--set", "task.name=tests.sandbox_conditions:GoldOrHostileMBPP", "--set", "group_size=2",
                        "--set", "prompts_per_step=2", "--set", "max_completion_tokens=8", "--set",
                        "max_prompt_tokens=32", "--set", "eval_n=2", "--set", "threads=1", "--set", "max_steps=2",
                        "--set", "record.displacement_every=0", "--set", "record.shift_at_eval=false", "--set",
                        "save_every=0", "--out", str(out)], capture_output=True, text=True,
                       env=env_without_bwrap(tmp_path, MECHDIAG_SHARED=os.environ.get("MECHDIAG_SHARED", "")),
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert [ln for ln in p.stderr.splitlines() if "warning" in ln] == [
        "mechdiag: warning: sandbox: auto: bubblewrap cannot be used here (bwrap is not on PATH); model code runs "
        "under landlock, seccomp and an unprivileged uid, without namespaces"]
    run = RunDir(out)
    assert run.summary()["sandbox"] == "landlock"
    metrics = run.read("metrics")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["reward/correctness"] == 0.5 and m["reward/code_blocked"] == 0.5 for m in metrics), metrics


HOG_IN_BATCH = ("import threading\ndef spin():\n    while True:\n        pass\n"
                "for _ in range(12):\n    threading.Thread(target=spin, daemon=True).start()\ndef f():\n    return 1\n",
                "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 30:\n    f()\n", ())


def test_verdicts_hold_beside_a_busy_neighbour_and_outside_hogs():
    # a sample of gold programs plus MBPP 123 (4.5-5.7 s of CPU): quiet; then behind a candidate that starts 12
    # busy threads, with two CPU hogs outside: the same verdicts, the neighbour ends at its own CPU limit
    ids, jobs = _gold_jobs(6)
    all_ids, all_jobs = _gold_jobs(None)
    i = all_ids.index("mbpp/123")
    ids, jobs = ids + [all_ids[i]], jobs + [all_jobs[i]]
    quiet = sandbox.run_many(jobs, workers=2, timeout_s=GOLD_TIMEOUT)
    assert all(r.passed for r in quiet), [(x, r.status) for x, r in zip(ids, quiet, strict=True) if not r.passed]
    hogs = [subprocess.Popen([sys.executable, "-c", GOLD_LOAD]) for _ in range(2)]
    try:
        loaded = sandbox.run_many([HOG_IN_BATCH] + jobs, workers=2, timeout_s=GOLD_TIMEOUT)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert loaded[0].status == "timeout" and loaded[0].duration_s < 40, loaded[0]
    assert [r.passed for r in loaded[1:]] == [r.passed for r in quiet], [
        (x, r.status, r.duration_s, r.waited_s) for x, r in zip(ids, loaded[1:], strict=True)]


BURN = "import time\ndef f(s):\n    t = time.process_time()\n    while time.process_time() - t < s:\n        pass\n"


def test_waiting_for_a_cpu_is_not_charged_to_the_backstop_sleeping_is():
    # three hogs on the run's own core: 1.5 s of CPU takes far longer than the 2.5 s backstop and still passes
    # (the time spent waiting for the core is not charged); a sleeper beside the same hogs ends at the backstop
    cpu = sandbox.cores()[0]
    hogs = [subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, [{cpu}])\n" + GOLD_LOAD])
            for _ in range(3)]
    try:
        time.sleep(0.5)
        busy = sandbox.run_tests(BURN, "f(1.5)\n", timeout_s=3, wall_s=2.5, cpu=cpu)
        sleeper = sandbox.run_tests("import time\ndef f():\n    time.sleep(60)\n", "f()\n", timeout_s=3, wall_s=2.5,
                                    cpu=cpu)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert busy.passed and busy.duration_s > 2.5 and busy.waited_s > 0, busy
    assert sleeper.status == "timeout" and 2.5 <= sleeper.duration_s - sleeper.waited_s <= 2.5 + SLACK + 1, sleeper


def test_a_tree_of_fresh_processes_is_held_to_the_cpu_limit():
    # each process stays under RLIMIT_CPU, but the tree keeps starting fresh ones: the tree's CPU time ends it
    code = ("import os, time\ndef f():\n    while True:\n        pid = os.fork()\n        if pid == 0:\n"
            "            t = time.process_time()\n            while time.process_time() - t < 0.4:\n"
            "                pass\n            os._exit(0)\n        os.waitpid(pid, 0)\n")
    r = sandbox._run(code, "f()\n", 1, 256, 16, 8, sandbox.MAX_OUTPUT, 60, (), "landlock", guard=False)
    assert r.status == "timeout" and r.duration_s < 30, r


def test_a_run_may_write_below_its_folder_cap_in_every_mode():
    # the cap stops a filler, not a program that uses its folder: 24 MiB in 6 files, read back, passes
    code = ("import os, tempfile\ndef f():\n    d = tempfile.mkdtemp()\n    for i in range(6):\n"
            "        with open(os.path.join(d, str(i)), 'wb') as fh:\n            fh.write(bytes([i]) * (4 << 20))\n"
            "    return sum(open(os.path.join(d, str(i)), 'rb').read().count(bytes([i])) for i in range(6))\n")
    for iso in ("bwrap", "landlock"):
        r = sandbox._run(code, "assert f() == 6 * (4 << 20)\n", 5.0, 512, 16, 8, sandbox.MAX_OUTPUT, 20.0, (), iso)
        assert (r.passed, r.status, r.isolation) == (True, "passed", iso), r
    (passed, status, _, iso, detail), = guard_only_runs([(code, "assert f() == 6 * (4 << 20)\n")])
    assert (passed, status, iso) == (True, "passed", "guard-only"), detail
