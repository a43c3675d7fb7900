"""The sandbox against a hostile corpus: every case is contained, scores 0 and ends within its time bound."""

from __future__ import annotations

import os
import signal
import time

import pytest

from mechdiag.sandbox import network_isolation, run_many, run_tests

TIMEOUT = 2.0
SLACK = 3.0  # seconds over the timeout a killed run may take on a loaded 2-core machine

# name -> (code, tests). Paths outside the working folder are filled in from the `outside` fixture.
CORPUS = {
    "infinite_loop": ("while True:\n    pass\n", ""),
    "busy_c_loop": ("x = 10 ** (10 ** 9)\n", ""),
    "sleep_forever": ("import time\ntime.sleep(60)\n", ""),
    "fork_bomb": ("import os\nwhile True:\n    os.fork()\n", ""),
    "subprocess_spawn": ("import subprocess\nsubprocess.run(['sh', '-c', 'touch {outside}/spawned'])\n", ""),
    "os_system": ("import os\nos.system('touch {outside}/system')\n", ""),
    "multiprocessing": ("import multiprocessing as mp\nmp.Process(target=print).start()\n", ""),
    "memory_bomb": ("x = []\nwhile True:\n    x.append(bytearray(1 << 24))\n", ""),
    "memory_one_shot": ("x = bytearray(1 << 34)\n", ""),
    "huge_output": ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", ""),
    "huge_file": ("with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * (1 << 20))\n", ""),
    "write_outside_abs": ("open('{outside}/written', 'w').write('x')\n", ""),
    "write_outside_rel": ("import os\nopen(os.path.relpath('{outside}/written_rel'), 'w').write('x')\n", ""),
    "write_via_dir_fd": ("import os\nd = os.open('{outside}', os.O_RDONLY)\n"
                         "os.close(os.open('dirfd', os.O_WRONLY | os.O_CREAT, dir_fd=d))\n", ""),
    "write_via_lib_dir_fd": ("import os, sys\nd = os.open(sys.base_prefix + '/lib', os.O_RDONLY)\n"
                             "os.close(os.open('escape', os.O_WRONLY | os.O_CREAT, dir_fd=d))\n", ""),
    "chdir_then_write": ("import os\nos.chdir('{outside}')\nopen('chdir', 'w').write('x')\n", ""),
    "delete_file": ("import os\nos.remove('{outside}/keep.txt')\n", ""),
    "delete_tree": ("import shutil\nshutil.rmtree('{outside}')\n", ""),
    "rename_file": ("import os\nos.rename('{outside}/keep.txt', 'stolen.txt')\n", ""),
    "read_env_secret": ("import os\nprint(dict(os.environ))\nassert os.environ.get('MECHDIAG_SECRET')\n", ""),
    "read_secret_file": ("print(open('{outside}/keep.txt').read())\n", ""),
    "read_proc_mem": ("open('/proc/self/mem', 'rb')\n", ""),
    "socket_connect": ("import socket\ns = socket.create_connection(('127.0.0.1', 9), timeout=1)\n", ""),
    "socket_raw": ("import _socket\n_socket.socket()\n", ""),
    "signal_parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGTERM)\n", ""),
    "signal_group": ("import os, signal\nos.killpg(0, signal.SIGKILL)\n", ""),
    "ctypes": ("import ctypes\nctypes.CDLL(None).fork()\n", ""),
    "exit0_before_tests": ("import sys\nsys.exit(0)\n", "assert False\n"),
    "os_exit0": ("import os\nos._exit(0)\n", "assert False\n"),
    "systemexit_in_tests": ("def f(x):\n    raise SystemExit(0)\n", "assert f(1) == 2\n"),
    "exit_from_thread": ("import os, threading, time\nthreading.Thread(target=lambda: os._exit(0)).start()\n"
                         "time.sleep(1)\n", "assert False\n"),
    "patch_assertionerror": ("import builtins\nbuiltins.AssertionError = ZeroDivisionError\ndef f(x):\n"
                             "    return 0\n", "assert f(1) == 2\n"),
    "always_equal": ("class A:\n    def __eq__(self, o):\n        return True\n    __hash__ = None\n"
                     "def f(x):\n    return A()\n", "assert f(1) == 2\n"),
    "always_equal_int_subclass": ("class A(int):\n    def __eq__(self, o):\n        return True\n"
                                  "def f(x):\n    return [A(0)]\n", "assert f(1) == [2]\n"),
    "patch_exec": ("import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.compile = lambda *a, **k: None\n",
                   "assert False\n"),
    "settrace_skip": ("import sys\ndef t(frame, ev, arg):\n    return t\nsys.settrace(t)\n", "assert False\n"),
    "find_nonce_frames": ("import sys\nf = sys._getframe()\nwhile f.f_back:\n    f = f.f_back\n"
                          "print([v for v in f.f_locals.values() if isinstance(v, bytes)])\n", "assert False\n"),
    "find_nonce_gc": ("import gc\nprint([o for o in gc.get_objects() if isinstance(o, bytes)])\n", "assert False\n"),
    "find_nonce_traceback": ("try:\n    1/0\nexcept ZeroDivisionError as e:\n    fr = e.__traceback__.tb_frame\n",
                             "assert False\n"),
    "read_stdin_nonce": ("import os\nprint(os.read(0, 100))\n", "assert False\n"),
    "forge_result_pipe": ("import os, sys\nos.write(int(sys.argv[1]), b'0' * 32 + b'\\n')\nos._exit(0)\n", ""),
    "raise_rlimit": ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))\n", ""),
    "pickle_payload": ("import pickle\npickle.loads(b\"cos\\nsystem\\n(S'touch {outside}/pickled'\\ntR.\")\n", ""),
    "wrong_answer": ("def f(x):\n    return x\n", "assert f(1) == 2\n"),
    "syntax_error": ("def f(x) return x\n", "assert f(1) == 1\n"),
}


@pytest.fixture
def outside(tmp_path):
    (tmp_path / "keep.txt").write_text("precious")
    return tmp_path


def _case(name, outside):
    code, tests = CORPUS[name]
    return code.replace("{outside}", str(outside)), tests


def test_isolation_mode_is_known():
    assert network_isolation() in ("netns", "audit-hook")


def test_correct_solution_passes_and_uses_stdlib():
    code = ("import re, collections, heapq, itertools, math, functools\n"
            "P = collections.namedtuple('P', 'x y')\n"
            "def f(s):\n    return sorted(collections.Counter(re.findall('[a-z]', s)).items())[0]\n")
    tests = "assert f('bab') == ('a', 1)\nassert P(1, 2).x == 1\nassert math.isclose(0.1 + 0.2, 0.3)\n"
    r = run_tests(code, tests, timeout_s=10)
    assert r.passed and r.status == "passed", r
    assert 0 < r.duration_s < 10


def test_file_work_inside_own_folder_is_allowed():
    code = ("import os, shutil, tempfile\n"
            "def f():\n"
            "    os.mkdir('d')\n"
            "    with open('d/a.txt', 'w') as fh:\n"
            "        fh.write('hi')\n"
            "    os.rename('d/a.txt', 'd/b.txt')\n"
            "    with tempfile.NamedTemporaryFile(dir='.', delete=True) as t:\n"
            "        t.write(b'x')\n"
            "    text = open('d/b.txt').read()\n"
            "    os.remove('d/b.txt')\n"
            "    shutil.rmtree('d')\n"
            "    return text\n")
    r = run_tests(code, "assert f() == 'hi'\n", timeout_s=10)
    assert r.passed, r


def test_hostile_corpus_contained(outside, monkeypatch):
    monkeypatch.setenv("MECHDIAG_SECRET", "hunter2-do-not-leak")
    names = list(CORPUS)
    t0 = time.monotonic()
    results = run_many([_case(n, outside) for n in names], workers=2, timeout_s=TIMEOUT, memory_mb=256)
    total = time.monotonic() - t0
    for name, r in zip(names, results, strict=True):
        assert not r.passed, (name, r)
        assert r.status != "passed", (name, r)
        assert r.duration_s < TIMEOUT + SLACK, (name, r.duration_s)
        assert "hunter2" not in r.detail, name
    by = dict(zip(names, results, strict=True))
    assert by["infinite_loop"].status == "timeout"
    assert by["sleep_forever"].status == "timeout"
    assert by["huge_output"].status == "output_limit"
    assert by["memory_bomb"].status in ("memory", "failed", "killed")
    assert by["exit0_before_tests"].status == "failed" and "SystemExit" in by["exit0_before_tests"].detail
    assert by["os_exit0"].status == "no_nonce"
    assert by["forge_result_pipe"].status == "no_nonce"
    assert "not allowed" in by["fork_bomb"].detail and "not allowed" in by["socket_connect"].detail
    # nothing escaped into the folder outside
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]
    assert (outside / "keep.txt").read_text() == "precious"
    # the whole corpus, two at a time, stays well under one timeout per case
    assert total < len(names) * TIMEOUT


def test_parent_survives_and_group_is_killed(tmp_path):
    # a child that ignores SIGTERM and sleeps: the wall-clock kill takes the whole group
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(30)\n"
    t0 = time.monotonic()
    r = run_tests(code, "", timeout_s=1.0)
    assert r.status == "timeout" and time.monotonic() - t0 < 1.0 + SLACK
    os.kill(os.getpid(), 0)  # still alive
    assert signal.getsignal(signal.SIGTERM) is not None


def test_working_folder_removed_and_env_scrubbed():
    code = "import os\nprint('CWD=' + os.getcwd())\nprint('ENV=' + ','.join(sorted(os.environ)))\n"
    r = run_tests(code, "assert False\n", timeout_s=5)
    assert not r.passed
    cwd = next(ln[4:] for ln in r.detail.splitlines() if ln.startswith("CWD="))
    env = next(ln[4:] for ln in r.detail.splitlines() if ln.startswith("ENV=")).split(",")
    assert "mechdiag-sbx-" in cwd and not os.path.exists(cwd)
    assert set(env) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL"}


def test_sockets_refused_even_in_tests():
    # in a private network namespace (where the OS allows) and refused by the audit hook in any case
    r = run_tests("import socket\n", "socket.socket()\n", timeout_s=5)
    assert not r.passed and "socket" in r.detail


def test_run_many_keeps_order_and_mixes_outcomes():
    jobs = [(f"def f():\n    return {i}\n", f"assert f() == {i if i % 3 else -1}\n") for i in range(8)]
    results = run_many(jobs, workers=2, timeout_s=10)
    assert [r.passed for r in results] == [i % 3 != 0 for i in range(8)]
    assert run_many([]) == []


def test_exit_code_alone_never_counts():
    # tests that pass, but the program then exits 1: not a pass; exit 0 without finishing: not a pass
    r = run_tests("import atexit, os\natexit.register(lambda: os._exit(3))\n", "assert True\n", timeout_s=5)
    assert r.passed  # atexit never runs: the harness leaves with os._exit after the nonce
    r = run_tests("def f():\n    import os\n    os._exit(0)\n", "f()\nassert True\n", timeout_s=5)
    assert not r.passed and r.status == "no_nonce"
