"""Verdicts nobody can forge (issue 40): the judge receives values, never names; the verdict channel carries one
message; correct programs that return bound methods, generators, classes and closures, or read their own /proc,
$HOME and files, pass in every mode; the task's helpers are the task's; runs of a batch share no IPC and no
folder; the host's cleanup holds on any tree; the hidden tests stay with the judge; parsing is linear."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mechdiag import sandbox
from mechdiag.tasks import get_task
from mechdiag.tasks.code import extract_code
from mechdiag.tasks.rewards import MAX_COMPLETION_CHARS, extract_reasoning, format_ok, xml_count
from tests.sandbox_conditions import guard_only_python

ROOT = Path(__file__).resolve().parent.parent
ARGS = (5.0, 256, 16, 8, sandbox.MAX_OUTPUT, 20.0)

# correct programs plain Python passes: each must pass in every mode, and none is `blocked`
CORRECT = (
    "import collections, textwrap, os\n"
    "most_common = collections.Counter('abracadabra').most_common\n"
    "wrap = textwrap.TextWrapper(width=10).wrap\n"
    "P = collections.namedtuple('P', 'x y')\n"
    "def gen(n):\n    yield from range(n)\n"
    "class Acc:\n    def __init__(self, v):\n        self.v = v\n    def add(self, k):\n        self.v += k\n"
    "        return self\n    def get(self):\n        return self.v\n"
    "def adder(a):\n    return lambda b: a + b\n"
    "def make():\n    return Acc\n"
    "def own_status():\n    return open('/proc/self/status').read().split(':')[0]\n"
    "def home_file():\n    p = os.path.join(os.environ['HOME'], 'note.txt')\n    open(p, 'w').write('hi')\n"
    "    return open(os.path.realpath(p)).read(), open(os.path.abspath('note.txt')).read()\n"
    "def point():\n    return tuple(P(1, 2))\n"
)
CORRECT_TESTS = (
    "assert most_common(2) == [('a', 5), ('b', 2)]\n"
    "assert wrap('aaa bbb ccc ddd') == ['aaa bbb', 'ccc ddd']\n"
    "assert list(gen(3)) == [0, 1, 2] and sorted(gen(3), reverse=True) == [2, 1, 0] and 2 in gen(3)\n"
    "assert sum(x * x for x in gen(4)) == 14\n"
    "assert Acc(1).add(2).add(3).get() == 6\n"
    "assert adder(2)(3) == 5\n"
    "a = make()(7)\nassert a.get() == 7 and make() is make()\n"
    "assert own_status() == 'Name'\n"
    "assert home_file() == ('hi', 'hi')\n"
    "assert point() == (1, 2)\n"
)
GUARD_ONLY_RUN = """
import json, sys
from mechdiag import sandbox
jobs = json.loads(sys.stdin.read())
print(json.dumps([[r.passed, r.status, r.blocked, r.isolation, r.detail[-300:]]
                  for r in (sandbox._run(c, t, 5.0, 256, 16, 8, sandbox.MAX_OUTPUT, 20.0, (), "guard-only")
                            for c, t in jobs)]))
"""


def guard_only_runs(jobs: list[tuple[str, str]]) -> list[list]:
    """Run (code, tests) jobs in guard-only, in an interpreter that mode accepts here."""
    python, extra = guard_only_python()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *extra]))
    p = subprocess.run([python, "-c", GUARD_ONLY_RUN], input=json.dumps(jobs), capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_correct_programs_pass_in_every_mode():
    # bound methods (Counter(...).most_common, TextWrapper(...).wrap), generators, classes, closures, namedtuple
    # (it asks for a frame), the program's own /proc/self, $HOME and its own files by real and absolute path
    for iso in ("bwrap", "landlock"):
        r = sandbox._run(CORRECT, CORRECT_TESTS, *ARGS, (), iso)
        assert (r.passed, r.blocked, r.isolation) == (True, False, iso), r
    (passed, status, blocked, iso, detail), = guard_only_runs([(CORRECT, CORRECT_TESTS)])
    assert (passed, blocked, iso) == (True, False, "guard-only"), (status, detail)


def test_wrong_programs_that_claim_a_stdlib_name_fail():
    # the old judge resolved a function's claimed __module__/__qualname__ to the real object and called that
    claims = ("def f(*a):\n    return [0]\nf.__module__ = 'builtins'\nf.__qualname__ = f.__name__ = 'sorted'\n"
              "import collections\ng = collections.Counter\n")
    r = sandbox._run(claims, "assert f([2, 1]) == [1, 2]\n", *ARGS, (), "bwrap")
    assert r.status == "failed" and not r.passed, r
    # a real stdlib object the solution holds is still called there, with the same result as plain Python
    r = sandbox._run(claims, "assert g('aab') == {'a': 2, 'b': 1}\n", *ARGS, (), "bwrap")
    assert r.passed, r


def _codec():
    spec = importlib.util.spec_from_file_location("sandboxed_codec", ROOT / "mechdiag" / "sandboxed" / "codec.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_codec_is_closed():
    codec = _codec()

    def no_ref(v, out):
        raise TypeError(type(v).__name__)

    value = {"a": [1, -2 ** 100, 2.5, 1j, None, True, False], ("t", b"\x00\xff"): frozenset({1, 2}),
             "s": {3}, "u": "\udcff\u00e9"}
    body = codec.dumps(value, no_ref)[4:]
    assert codec.loads(body, lambda n: ("ref", n)) == value
    with pytest.raises(TypeError):
        codec.dumps(object(), no_ref)
    bad = [b"X", b"l\x00\x00\x00\x05N", b"NN", b"B\x00\x00\x00\x03int", b"s\xff\xff\xff\xffab", b"i\x00\x00",
           b"k\x00\x00\x00\x06os.sep", b"m\x00\x00\x00\x09", b"n\x00\x00\x00\x00f" + b"\x00" * 8,
           b"l\x00\x00\x00\x01" * 5000 + b"N"]
    for frame in bad:  # unknown tags, counts past the end, trailing bytes, a name where only values may come,
        # a NaN tag holding a number, nesting deeper than the decoder: each refused, none builds anything
        with pytest.raises(codec.Malformed):
            codec.loads(frame, lambda n: ("ref", n))


def test_the_verdict_channel_takes_one_message_of_this_runs_judge():
    token = "ab" * 16
    ok = f"mechdiag-verdict {token} pass\n".encode()
    assert sandbox._verdict(ok, token) == ["pass"]
    assert sandbox._verdict(f"mechdiag-verdict {token} fail error blocked\n".encode(), token) == [
        "fail", "error", "blocked"]
    for raw in (b"pass\n" + ok, ok + ok, ok + b"pass\n", ok[:-1], b"pass\n", ok.replace(b"ab", b"cd"),
                f"mechdiag-verdict {token} pass blocked extra\n".encode(), b""):
        assert sandbox._verdict(raw, token) is None, raw


def test_task_helpers_come_from_the_task():
    # HumanEval 32, 38, 50: the tests call a helper the prompt defines (poly, encode_cyclic, encode_shift); a
    # completion that redefines it (and writes a wrong solution that fits its own helper) used to pass. Through
    # the trainer's code-reward path (the task's components_many): the gold completions pay, the rigged do not.
    task = get_task("humaneval")
    exs = {e.id: e for e in task.examples("test")}
    rigged = {
        "HumanEval/32": "def poly(xs, x):\n    return 0\n\ndef find_zero(xs):\n    return 0.0\n",
        "HumanEval/38": "def encode_cyclic(s):\n    return s\n\ndef decode_cyclic(s):\n    return s\n",
        "HumanEval/50": "def encode_shift(s):\n    return s\n\ndef decode_shift(s):\n    return s\n",
    }
    examples = [exs[k] for k in rigged] * 2
    completions = [f"<reasoning>x</reasoning><answer>\n```python\n{c}```\n</answer>" for c in rigged.values()]
    completions += [e.meta["gold_completion"] for e in examples[:3]]
    got = task.components_many(completions, examples)
    assert [g["correctness"] for g in got] == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0], got


IPC_WRITER = ("import ctypes\ndef f():\n    libc = ctypes.CDLL(None, use_errno=True)\n"
              "    q = libc.msgget(0x4D444942, 0o1666)\n"
              "    buf = ctypes.create_string_buffer(b'\\x01\\0\\0\\0\\0\\0\\0\\0SECRET42', 16)\n"
              "    return [q, libc.msgsnd(q, buf, 8, 0) if q >= 0 else -1]\n")
IPC_READER = ("import ctypes, time\ndef f():\n    libc = ctypes.CDLL(None, use_errno=True)\n"
              "    for _ in range(20):\n        q = libc.msgget(0x4D444942, 0)\n        if q >= 0:\n"
              "            buf = ctypes.create_string_buffer(16)\n"
              "            if libc.msgrcv(q, buf, 8, 0, 0o4000) > 0:\n                return buf.raw[8:16]\n"
              "        time.sleep(0.05)\n    return b''\n")
FOLDER_WRITER = ("import os, time\ndef f():\n    open('mine.txt', 'w').write('SECRET42')\n    time.sleep(1.0)\n"
                 "    return 1\n")
FOLDER_READER = ("import glob, os, time\ndef f():\n    time.sleep(0.3)\n    found = ''\n"
                 "    for p in glob.glob('/tmp/mechdiag-sbx-*/mine.txt') + glob.glob('/proc/*/cwd/mine.txt'):\n"
                 "        try:\n            found += open(p).read()\n        except OSError:\n            pass\n"
                 "    return found\n")


FDS = "import os\ndef f():\n    return sorted(int(x) for x in os.listdir('/proc/self/fd'))\n"


@pytest.mark.parametrize("iso", ["bwrap", "landlock"])
def test_a_host_holding_many_descriptors_runs_and_leaks_none(iso):
    # a busy host (a batch side by side, a trainer's files) hands the run's pipes numbers past the 64-descriptor
    # cap: the run still starts (the landlock mode opened descriptors of its own under that cap and died), and
    # it holds its three channels and stdio only, none of the host's
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(100)]
    try:
        r = sandbox._run(FDS, "print(f())\n", *ARGS, (), iso, guard=False)
    finally:
        for fd in held:
            os.close(fd)
    assert r.passed, (r.status, r.detail)
    fds = json.loads(r.detail.strip().splitlines()[-1])
    assert len(fds) <= 7 and not set(fds) & set(held[:50]), fds


def _sysv_left(key: int) -> int:
    rows = [line.split() for kind in ("shm", "msg", "sem")
            for line in Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]]
    return sum(1 for row in rows if row and int(row[0]) == key)


@pytest.mark.parametrize("iso", ["bwrap", "landlock"])
def test_runs_of_a_batch_share_no_ipc_and_no_folder(iso):
    # guard off: a run that writes a SysV message queue (or a file in its folder) and a run beside it that looks
    # for it: the reader finds nothing, no IPC object is left on the host
    jobs = [(IPC_WRITER, "print(f())\n"), (IPC_READER, "assert f() == b'SECRET42'\n"),
            (FOLDER_WRITER, "f()\n"), (FOLDER_READER, "assert 'SECRET42' in f()\n")]
    cpu = sandbox.cores()[0]
    with ThreadPoolExecutor(4) as pool:  # side by side, as run_many runs a batch
        results = list(pool.map(lambda j: sandbox._run(j[0], j[1], *ARGS, (), iso, guard=False, cpu=cpu), jobs))
    assert [r.passed for r in results] == [True, False, True, False], [(r.status, r.detail) for r in results]
    assert "[-1, -1]" in results[0].detail  # msgget refused (seccomp), whatever the namespace
    assert _sysv_left(0x4D444942) == 0


def test_cleanup_holds_on_a_tree_deeper_than_the_recursion_limit(tmp_path):
    # the host removes a run's folder however deep it is (shutil.rmtree raises RecursionError here); built in a
    # tmpfs where there is one (the disk's rmdir is what costs here, not the walk)
    base = Path(tempfile.mkdtemp(dir="/dev/shm")) if os.path.isdir("/dev/shm") else tmp_path
    top = base / "run"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY)
    for _ in range(sys.getrecursionlimit() + 200):
        os.mkdir("d", dir_fd=fd)
        nxt = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(fd)
    sandbox._remove_tree(str(top))
    assert not top.exists()
    if base != tmp_path:
        base.rmdir()


def test_parsing_is_linear_under_the_cap():
    # 8 KB and 64 KB of `<answer>` (and of reasoning tags, fences, blank lines): 8x the text costs well under the
    # 64x a quadratic parse would (it took 32 s at 64 KB); past the cap a completion is cut first
    def cost(text: str) -> float:
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            extract_code(text)
            extract_reasoning(text)
            xml_count(text)
            format_ok(text)
            best = min(best, time.perf_counter() - t0)
        return best

    for unit in ("<answer>", "<reasoning></reasoning>", "```", "\n", "<think>x</think>\n<answer>"):
        small, big = ((unit * (k * 1024 // len(unit) + 1))[: k * 1024] for k in (8, 64))
        assert cost(big) < 0.25 and cost(big) < 24 * max(cost(small), 1e-5), unit
    assert cost("<answer>" * (MAX_COMPLETION_CHARS // 2)) < 0.5


def test_hidden_tests_are_only_in_the_judge():
    # run_tests: the tests live in the judge's memory, sent on its stdin and on no disk the candidate sees; the
    # candidate looks for a marker of them in every process's fds, environ and cmdline it can open, and in the
    # task data on disk: found nowhere, in every mode
    from mechdiag.paths import shared_path  # noqa: PLC0415

    look = ("import os\ndef f(data):\n    out = b''\n    for p in ['self'] + os.listdir('/proc'):\n        for n in "
            "['cmdline', 'environ'] + ['fd/' + x for x in (os.listdir('/proc/%s/fd' % p) "
            "if os.access('/proc/%s/fd' % p, os.R_OK) else [])]:\n            try:\n"
            "                r = os.open('/proc/%s/%s' % (p, n), os.O_RDONLY | os.O_NONBLOCK)\n"
            "                out += os.read(r, 1 << 16)\n            except OSError:\n                pass\n"
            "    try:\n        out += open(data, 'rb').read()\n    except OSError:\n        pass\n"
            "    return b'zq-marker-4471' in out or b'remove_Occ' in out\n")
    tests = f"MARK = 'zq-marker-' + str(4400 + 71)\nassert f({str(shared_path('data', 'mbpp', 'mbpp.jsonl'))!r})\n"
    for iso in ("bwrap", "landlock"):
        r = sandbox._run(look, tests, *ARGS, (), iso, guard=False)
        assert not r.passed and r.status == "failed", (iso, r)
    (passed, status, _, iso, detail), = guard_only_runs([(look, tests)])
    assert not passed and iso == "guard-only", (status, detail)
