"""Run model-written code against trusted tests: the candidate runs isolated, the verdict comes from a judge.

Two processes per run, both started by the caller (the host); the programs are files in mechdiag/sandboxed/:
- the candidate: `python -I -S candidate.py`, isolated by one of (isolation()):
  bwrap: bubblewrap (new pid, net, ipc, uts namespaces, a user namespace when not root; the interpreter's prefix,
  /usr, the programs and /etc/localtime read-only; a private 64 MiB tmpfs as its work folder; /proc read-only;
  no home, /root, host /tmp or project; --die-with-parent, --new-session) and its seccomp filter;
  landlock: no user namespace (containers without them): an unprivileged uid, no_new_privs, a landlock
  domain and a wider seccomp filter, set between fork and exec (mechdiag/sandbox_landlock.py); as root with
  CAP_SYS_ADMIN also a mount and IPC namespace of its own with a 64 MiB tmpfs as its folder;
  guard-only (named by the user): the uid drop (no capability kept: refused where the interpreter needs one)
  and the seccomp filter;
  always under rlimits and with the in-process guard (an audit hook): under guard-only it refuses what it
  watches; under bwrap and landlock, which contain all of it, it records the attempt (`blocked`) and lets the
  kernel answer. It executes the solution, then serves calls: it never sees the tests.
- the judge: a clean `python -I -S judge.py`, confined (its own uid as root, a landlock domain that reads the
  interpreter and writes nothing, the "judge" seccomp rows; a bubblewrap of its own where landlock cannot),
  that executes the tests. Every name the tests take from the solution is the value the candidate sends, in a
  closed codec (codec.py: None, bool, int, float, complex, str, bytes; list, tuple, dict, set, frozenset
  nested); anything else stays in the candidate as a handle the tests may call, iterate, read or set
  attributes of, or pass back, each done in the candidate's process; using it as data (==, bool, hash, str,
  ...) fails the test (status `nonplain`). Nothing the candidate names is looked up on the judge's side.
A pass is exactly one message on a pipe only the judge holds, `mechdiag-verdict TOKEN pass` (TOKEN: this run's,
sent on the judge's stdin), and the judge's exit status 0; anything else on that pipe is a protocol error
(status `protocol`, counted in PROTOCOL_ERRORS).

Deadlines: CPU seconds (RLIMIT_CPU per process, and timeout_s + 1 for the candidate's whole tree), so a verdict
does not depend on machine load; a wall-clock backstop WALL_FACTOR times longer, for sleepers: time the run
spends waiting for a CPU is not charged to it. run_many gives each run one core (candidate and judge pinned).
sandbox: auto takes bwrap, else landlock, else refuses (SandboxUnavailable); see `use`.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import os
import queue
import re
import resource
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from mechdiag import sandbox_landlock as landlock
from mechdiag.errors import UserError

MAX_OUTPUT = 1 << 20  # bytes of stdout+stderr read back before the run is killed
DETAIL_CHARS = 2000
WALL_FACTOR = 4.0  # wall-clock backstop = WALL_FACTOR * timeout_s (CPU seconds), for sleepers
STARVED_FACTOR = 10.0  # time spent waiting for a CPU is not charged to the backstop, up to this many backstops
MAX_MESSAGE = 8 << 20  # bytes of one message between judge and candidate
TMP_BYTES = 64 << 20  # what a run may write: bwrap's one tmpfs (host RAM outside RLIMIT_AS), landlock's private folder
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap) for OS isolation of model code"


@dataclass
class SandboxResult:
    passed: bool
    # passed | failed | timeout | memory | output_limit | disk_limit | nonplain | blocked | exited | killed |
    # protocol (the verdict channel held anything but the judge's one message) | error
    status: str
    duration_s: float
    detail: str = ""
    blocked: bool = False  # an attempt some layer stopped (seen by the guard), or the solution returned non-plain data
    isolation: str = ""  # bwrap | landlock | guard-only
    waited_s: float = 0.0  # time the run's processes waited for a CPU (measured once the backstop was reached)


class SandboxUnavailable(UserError):
    """sandbox: strict, and no OS isolation here."""


# the two programs (candidate, judge) and their codec: real modules; bwrap binds the folder here
PROGRAMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandboxed")
PROGRAMS_INSIDE = "/sandbox"


def launch(name: str, folder: str) -> list[str]:
    """The interpreter's arguments that run program `name` ('candidate' or 'judge') from `folder`: imported (its
    bytecode cached beside it: no compile per run), the folder on the path only while it loads."""
    _compiled()
    return ["-I", "-S", "-c", f"import sys; sys.path.insert(0, {folder!r}); import {name}; del sys.path[0]; "
                              f"{name}.main()"]


@functools.lru_cache(maxsize=1)
def _compiled() -> bool:
    """Write the programs' bytecode once (pip writes it at install; a source checkout here), where writable."""
    import compileall  # noqa: PLC0415 - once per process, on the first run

    return bool(compileall.compile_dir(PROGRAMS, quiet=2, force=False))


NOFILE = 64  # descriptors a run's process may hold


def _limits(timeout_s: float, memory_mb: int, max_procs: int, max_file_mb: int,
            fds: tuple[int, ...] = ()) -> list[tuple[int, int, int]]:
    """The rlimits of a run's processes. The descriptor cap is NOFILE, or one past the highest descriptor the
    child is passed where the host has handed out more (a busy host, runs side by side)."""
    cpu = int(math.ceil(timeout_s))
    nofile = max([NOFILE, *(fd + 1 for fd in fds)])
    mem = int(memory_mb) * 1024 * 1024
    fsize = int(max_file_mb) * 1024 * 1024
    return [(resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, mem, mem),
            (resource.RLIMIT_NPROC, max_procs, max_procs), (resource.RLIMIT_FSIZE, fsize, fsize),
            (resource.RLIMIT_NOFILE, nofile, nofile), (resource.RLIMIT_CORE, 0, 0)]


def _make_preexec(limits, cpu=None, then=None):
    """The child's setup between fork and exec: rlimits, its one core (`cpu`), then `then` (the landlock mode's
    confinement), then the descriptor cap: until exec the child holds every descriptor of the host, and `then`
    opens some of its own."""
    setrlimit, getrlimit, setaffinity = resource.setrlimit, resource.getrlimit, getattr(os, "sched_setaffinity", None)
    nofile = resource.RLIMIT_NOFILE

    def apply(which, soft, hard):
        try:
            setrlimit(which, (soft, hard))
        except (ValueError, OSError):  # hard limit already lower here, or a limit this OS lacks
            try:
                setrlimit(which, (min(soft, getrlimit(which)[1]), getrlimit(which)[1]))
            except (ValueError, OSError):
                pass

    def preexec():  # runs in the child between fork and exec: C calls only, nothing imported here
        for which, soft, hard in limits:
            if which != nofile:
                apply(which, soft, hard)
        if cpu is not None and setaffinity is not None:
            try:
                setaffinity(0, (cpu,))
            except OSError:
                pass
        if then is not None:
            then()
        for which, soft, hard in limits:
            if which == nofile:
                apply(which, soft, hard)

    return preexec


def _python() -> str:
    """The real interpreter behind sys.executable (a venv's python is a link to it)."""
    return os.path.realpath(sys.executable)


def _prefixes() -> set[str]:
    """The interpreter's folders the candidate reads (real paths)."""
    return {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix,
                                          os.path.dirname(os.path.dirname(_python())))}


def _bwrap_args(bwrap: str) -> list[str]:
    # as root, no user namespace (its uid 65534 would map to host uid 0): the candidate drops to a uid of its own
    # first thing (see sandboxed/candidate.py); as a user, a user namespace mapping 65534 to that user
    user = [] if os.geteuid() == 0 else ["--unshare-user", "--uid", "65534", "--gid", "65534"]
    args = [bwrap, *user, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session",
            "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for p in sorted(_prefixes()):
        if not (p == "/usr" or p.startswith("/usr/")):
            parts = p.strip("/").split("/")
            for i in range(1, len(parts)):  # bwrap makes missing parents 0700: the dropped uid must pass them
                args += ["--perms", "0755", "--dir", "/" + "/".join(parts[:i])]
            args += ["--ro-bind", p, p]
    # /proc read-only (no sysctl writes); /dev a read-only folder of three devices (no /dev/shm: POSIX shared
    # memory has nowhere to live); /tmp the one writable tmpfs, capped
    args += ["--ro-bind", PROGRAMS, PROGRAMS_INSIDE, "--ro-bind-try", "/etc/localtime", "/etc/localtime",
             "--proc", "/proc", "--remount-ro", "/proc",
             "--size", str(64 << 10), "--tmpfs", "/dev"]
    for dev in ("null", "zero", "urandom"):
        args += ["--dev-bind", f"/dev/{dev}", f"/dev/{dev}"]
    args += ["--symlink", "/proc/self/fd", "/dev/fd", "--remount-ro", "/dev",
             "--perms", "1777", "--size", str(TMP_BYTES), "--tmpfs", "/tmp", "--remount-ro", "/", "--chdir", "/tmp",
             "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp", "--"]
    return args


def seccomp_program() -> bytes | None:
    """bwrap's filter (the "bwrap" rows of sandbox_landlock.SECCOMP_RULES, the one definition of every filter);
    None where pyseccomp or libseccomp is not installed (the `sandbox` extra)."""
    return landlock.bpf_program("bwrap")


def _seccomp_fd(args: list[str]) -> int | None:
    """Add `--seccomp FD` to bwrap's args (before its `--`); the fd (a memfd holding the program) to pass and close."""
    prog = seccomp_program()
    if prog is None:
        return None
    fd = os.memfd_create("mechdiag-seccomp")
    os.write(fd, prog)
    os.lseek(fd, 0, os.SEEK_SET)
    args[-1:-1] = ["--seccomp", str(fd)]
    return fd


_UID_POOL = 1 << 20  # candidate uids drawn from this many (one per run, so RLIMIT_NPROC counts one run's processes)
_UIDS: list[int] | None = None
_COUNTER = itertools.count()


def _uid_range() -> tuple[int, int]:
    """(first, count) of the uids this process may switch to: the widest range of its user namespace's map."""
    try:
        with open("/proc/self/uid_map") as fh:
            rows = [tuple(int(x) for x in line.split()) for line in fh if line.strip()]
    except OSError:
        rows = []
    if not rows:
        return 65534, 1
    inner, _outer, count = max(rows, key=lambda r: r[2])
    return inner, count


def _candidate_uid() -> str:
    """The uid the candidate switches to before it reads model code ('-': none, the host is not root). Root's
    limits are not enforced (RLIMIT_NPROC) and root may write /proc and /sys: the candidate never keeps uid 0."""
    if os.geteuid() != 0:
        return "-"
    first, count = _uid_range()
    if count > 2 * _UID_POOL:  # the top of the range: far from real users, distinct per run
        base = first + count - 1 - _UID_POOL
        return str(base + (os.getpid() * 4099 + next(_COUNTER)) % _UID_POOL)
    return str(65534 if first <= 65534 < first + count else first + count - 1)


_REASONS: dict[str, str | None] = {}  # isolation -> None where it works here, else why not (probed once)
_MODE = "auto"
_WARNED = False
_LOCK = threading.Lock()
_PROBE_LOCK = threading.Lock()


def _reason(iso: str) -> str | None:
    """Why `iso` ('bwrap' or 'landlock') cannot isolate model code here (one phrase); None where it can. Probed once
    per process by starting the interpreter the way a run does, as the candidate's dropped uid."""
    with _PROBE_LOCK:
        if iso not in _REASONS:
            _REASONS[iso] = _probe_bwrap() if iso == "bwrap" else _probe_landlock()
        return _REASONS[iso]


def _probe_bwrap() -> str | None:
    bwrap = shutil.which("bwrap")
    if not bwrap or not sys.platform.startswith("linux"):
        return "bubblewrap cannot be used here (bwrap is not on PATH)"
    args = _bwrap_args(bwrap)
    fd = _seccomp_fd(args)
    try:
        probe = subprocess.run(args + [_python(), *launch("candidate", PROGRAMS_INSIDE), "probe", "-", "-",
                                       _candidate_uid()], capture_output=True, text=True, timeout=30,
                               stdin=subprocess.DEVNULL, cwd="/", pass_fds=() if fd is None else (fd,))
    except (OSError, subprocess.SubprocessError) as e:
        return f"bubblewrap cannot be used here ({e})"
    finally:
        if fd is not None:
            os.close(fd)
    if probe.returncode == 0 and probe.stdout.strip() == "ok":
        return None
    last = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
    return f"bubblewrap cannot be used here ({last[:200]})"


def _probe_landlock() -> str | None:
    why = landlock.refusal(landlock.abi(), os.geteuid() == 0)
    if why is None and landlock.bpf_program("bare") is None:
        why = "pyseccomp or libseccomp2 is missing (pip install 'mechdiag[sandbox]', apt-get install libseccomp2)"
    if why is not None:
        return why
    private = tempfile.mkdtemp(prefix="mechdiag-probe-")
    try:
        uid = _candidate_uid()
        if uid != "-":
            os.chown(private, int(uid), int(uid))
        conf = _confinement(private, uid)
        try:
            probe = subprocess.run([_python(), *launch("candidate", PROGRAMS), "probe", "-", "-", "-"],
                                   capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
                                   cwd=private, env={"PATH": "/usr/bin:/bin"}, preexec_fn=conf.preexec)
        finally:
            conf.close()
    except (OSError, subprocess.SubprocessError) as e:
        return f"the confined interpreter cannot start ({e})"
    finally:
        _remove_tree(private)
    if probe.returncode == 0 and probe.stdout.strip() == "ok":
        return None
    last = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
    return f"the confined interpreter cannot start ({last[:200]})"


@functools.lru_cache(maxsize=1)
def _own_mounts() -> bool:
    """Whether runs without bubblewrap get a mount and IPC namespace of their own, with a tmpfs of TMP_BYTES as
    their folder: as root with CAP_SYS_ADMIN (a container's root often lacks it). Probed once, by a child that
    tries it and starts /bin/true."""
    if os.geteuid() != 0 or not os.path.exists("/bin/true"):
        return False
    private = tempfile.mkdtemp(prefix="mechdiag-probe-")
    try:
        uid = int(_candidate_uid())
        os.chown(private, uid, uid)
        conf = landlock.Confinement(0, [], {}, private, uid, b"", False, TMP_BYTES)
        return subprocess.run(["/bin/true"], cwd=private, preexec_fn=conf.preexec, stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError, ValueError):
        return False
    finally:
        _remove_tree(private)


def _confinement(private: str, uid: str, with_landlock: bool = True) -> landlock.Confinement:
    """The kernel objects for one run's candidate whose private folder is `private`: the uid drop (as root), the
    seccomp filter ("bare" rows), landlock, and (as root, where it can) a tmpfs and IPC namespace of its own;
    with_landlock=False (guard-only): no landlock, and no capability kept."""
    folders, files = landlock.system_paths(_prefixes(), PROGRAMS)
    prog = landlock.bpf_program("bare")
    assert prog is not None or not with_landlock  # the probe refused the landlock mode without it
    u = None if uid == "-" else int(uid)
    return landlock.Confinement(landlock.abi() if with_landlock else 0, folders, files, private, u, prog or b"",
                                with_landlock and u is not None and _needs_read_cap(tuple(folders)),
                                TMP_BYTES if u is not None and _own_mounts() else 0)


@functools.lru_cache(maxsize=1)
def _judge_domain() -> landlock.Confinement | None:
    """The judge's landlock domain, built once per process (it names nothing of a run): None where landlock cannot
    hold here."""
    if landlock.refusal(landlock.abi(), os.geteuid() == 0) is not None:
        return None
    folders, files = landlock.system_paths(_prefixes(), PROGRAMS)
    domain = landlock.Confinement(landlock.abi(), folders, files, None, None, landlock.bpf_program("judge") or b"",
                                  _needs_read_cap(tuple(folders)))
    domain.shared = True  # runs share its ruleset: never closed by one of them
    return domain


def _judge_confinement(uid: str) -> landlock.Confinement | None:
    """The judge's confinement where landlock holds here: its own uid (as root), the "judge" seccomp rows, a
    landlock domain that reads the interpreter and the programs and writes nothing. None where landlock cannot
    (then the judge runs in a bubblewrap of its own, or, in guard-only, under its uid and filter alone)."""
    domain = _judge_domain()
    if domain is None:
        return None
    conf = copy.copy(domain)
    conf.uid = None if uid == "-" else int(uid)
    return conf


@functools.lru_cache(maxsize=4)
def _needs_read_cap(folders: tuple[str, ...]) -> bool:
    return landlock.needs_read_cap(list(folders))


def _guard_only_refusal() -> str | None:
    """Why guard-only cannot hold here (one line), else None: as root, the candidate's unprivileged uid must reach
    the interpreter without any capability (CAP_DAC_READ_SEARCH would let it read every file on the host, with
    no landlock to bound it)."""
    if os.geteuid() != 0 or not _needs_read_cap(tuple(landlock.system_paths(_prefixes(), PROGRAMS)[0])):
        return None
    return (f"sandbox: guard-only cannot hold here: the interpreter ({_python()}) sits in a folder only root may "
            f"enter, and the candidate's unprivileged uid would need CAP_DAC_READ_SEARCH, which reads every file "
            f"on the host; use a Python every user can read, or bubblewrap or landlock")


def isolation() -> str:
    """The strongest isolation model code can get in this process: 'bwrap' (namespaces, seccomp, guard),
    'landlock' (no namespaces: unprivileged uid, landlock, seccomp, guard; where bwrap cannot run, e.g. a
    container without user namespaces) or 'guard-only' (the audit hook alone: run only when the user asked for
    sandbox: guard-only)."""
    if _reason("bwrap") is None:
        return "bwrap"
    return "landlock" if _reason("landlock") is None else "guard-only"


MODES = ("auto", "strict", "landlock", "guard-only")


def use(mode: str) -> str:
    """Set the policy and return the isolation in force. 'auto': bwrap, else landlock, else SandboxUnavailable
    (model code never runs unisolated by default). 'strict': bwrap only. 'landlock': the no-namespace mode, even
    where bwrap works. 'guard-only': the weaker mode, named by the user: the best of the three, down to the
    in-process guard alone (with a warning)."""
    global _MODE
    if mode not in MODES:
        raise UserError(f"sandbox must be one of {', '.join(MODES)}, got {mode!r}")
    _MODE = mode
    return _check()


def _warn_once(text: str) -> None:
    global _WARNED
    with _LOCK:
        if not _WARNED:
            _WARNED = True
            print("mechdiag: warning: " + text, file=sys.stderr, flush=True)


def _check() -> str:
    if _MODE == "strict":
        why = _reason("bwrap")
        if why is not None:
            raise SandboxUnavailable(f"sandbox: strict, but {why}, and strict runs model code only under "
                                     f"bubblewrap; {INSTALL_HINT}, or set sandbox: auto")
        iso = "bwrap"
    elif _MODE == "landlock":
        why = _reason("landlock")
        if why is not None:
            raise SandboxUnavailable(f"sandbox: landlock, but {why}")
        iso = "landlock"
    else:
        iso = isolation()
        if iso == "guard-only":
            if _MODE != "guard-only":
                raise SandboxUnavailable(f"sandbox: {_MODE}, but {_reason('bwrap')} and landlock cannot either "
                                         f"({_reason('landlock')}), and model code does not run without OS "
                                         f"isolation; {INSTALL_HINT}, or set sandbox: guard-only to run it under "
                                         f"the in-process guard alone")
            if _guard_only_refusal() is not None:
                raise SandboxUnavailable(_guard_only_refusal())
            _warn_once(f"sandbox: guard-only: model code runs under the in-process guard only (no OS isolation); "
                       f"{INSTALL_HINT}")
        elif iso == "landlock":
            _warn_once(f"sandbox: {_MODE}: {_reason('bwrap')}; model code runs under landlock, seccomp and an "
                       f"unprivileged uid, without namespaces")
    if iso == "bwrap" and seccomp_program() is None:
        _warn_once("pyseccomp or libseccomp2 is missing: bubblewrap runs model code without its seccomp filter; "
                   "pip install 'mechdiag[sandbox]' (and apt-get install libseccomp2)")
    return iso


def run_tests(code: str, tests: str, timeout_s: float = 5.0, memory_mb: int = 512, max_procs: int = 16,
              max_file_mb: int = 8, max_output: int = MAX_OUTPUT, wall_s: float | None = None,
              entry_points: tuple[str, ...] | list[str] = (), cpu: int | None = None) -> SandboxResult:
    """Run `code` in the sandbox and `tests` (trusted) in a judge that reaches the code through handles.

    Where the tests live: in the judge's memory only. The host sends them on the judge's stdin (after a one-run
    token) and writes them to no file; the candidate cannot see the judge (bwrap: another pid namespace;
    landlock: no /proc but its own; guard-only: another uid, and the guard), nor the task data on disk. The
    judge receives values from the candidate, never names; its one message on a pipe only it holds is the
    verdict.

    timeout_s: CPU seconds, for each of the candidate and the judge; wall_s: the wall-clock backstop (default
    WALL_FACTOR * timeout_s, not charged while the run waits for a CPU). entry_points: solution names the tests
    may take even where they shadow a builtin. cpu: the one core candidate and judge run on (run_many's).
    """
    return _run(code, tests, timeout_s, memory_mb, max_procs, max_file_mb, max_output,
                WALL_FACTOR * timeout_s if wall_s is None else wall_s, tuple(entry_points), _check(), cpu=cpu)


def _run(code, tests, timeout_s, memory_mb, max_procs, max_file_mb, max_output, wall_s, entry, iso,
         guard: bool = True, cpu: int | None = None) -> SandboxResult:
    t0 = time.monotonic()
    if iso == "guard-only" and _guard_only_refusal() is not None:
        return SandboxResult(False, "error", 0.0, _guard_only_refusal(), isolation=iso)
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    res_r, res_w = os.pipe()
    out_r, out_w = os.pipe()
    flag_r, flag_w = os.pipe()  # the guard's word that it saw an attempt (one byte), whatever the run does next
    cand_dir = None if iso == "bwrap" else tempfile.mkdtemp(prefix="mechdiag-sbx-")
    uid = _candidate_uid()
    judge_uid = _candidate_uid()
    while judge_uid == uid != "-":
        judge_uid = _candidate_uid()
    own_mounts = cand_dir is not None and uid != "-" and _own_mounts()
    # bwrap's tmpfs and a run's own tmpfs (root) are capped by the kernel; else the host holds the folder to its cap
    usage = None if cand_dir is None or own_mounts else _FolderUsage(cand_dir, TMP_BYTES)
    if cand_dir is not None and uid != "-":
        os.chown(cand_dir, int(uid), int(uid))  # the candidate's own folder, writable by its uid
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    python = _python()
    programs = PROGRAMS_INSIDE if iso == "bwrap" else PROGRAMS
    conf = None
    if iso in ("landlock", "guard-only"):
        # the uid drop happens between fork and exec, with the seccomp filter (and landlock in its mode)
        conf = _confinement(cand_dir, uid, iso == "landlock")
        uid = "-"
    cand_cmd = [python, *launch("candidate", programs), str(req_r), str(resp_w), iso if guard else "none", uid,
                str(flag_w)]
    # the judge: confined by landlock where it holds (every mode), else by a bubblewrap of its own (bwrap mode),
    # else (guard-only) by its own uid and the judge's seccomp filter
    jconf = _judge_confinement(judge_uid)
    judge_programs, judge_wrap, judge_filter = PROGRAMS, [], None
    if jconf is None and iso == "bwrap":
        judge_wrap = _bwrap_args(shutil.which("bwrap") or "bwrap")
        judge_filter = _seccomp_fd(judge_wrap)
        judge_programs = PROGRAMS_INSIDE
    elif jconf is None:
        folders, files = landlock.system_paths(_prefixes(), PROGRAMS)
        jconf = landlock.Confinement(0, folders, files, None, None if judge_uid == "-" else int(judge_uid),
                                     landlock.bpf_program("judge") or b"", False)
    if jconf is not None:
        judge_uid = "-"
    judge_cmd = judge_wrap + [python, *launch("judge", judge_programs), str(req_w), str(resp_r), str(res_w),
                              str(MAX_MESSAGE), ",".join(entry), judge_uid]
    filter_fd = None
    if iso == "bwrap":
        args = _bwrap_args(shutil.which("bwrap") or "bwrap")
        filter_fd = _seccomp_fd(args)
        cand_cmd = args + cand_cmd
    token = secrets.token_hex(16)
    procs: list[subprocess.Popen] = []
    extra = tuple(fd for fd in (filter_fd, judge_filter) if fd is not None)
    child_fds = (req_r, req_w, resp_r, resp_w, res_w, out_w, flag_w) + extra
    limits = _limits(timeout_s, memory_mb, max_procs, max_file_mb, child_fds)
    try:
        try:
            cand = subprocess.Popen(
                cand_cmd, cwd=cand_dir or "/", stdin=subprocess.PIPE, stdout=out_w, stderr=out_w,
                env=dict(env, HOME=cand_dir or "/tmp", TMPDIR=cand_dir or "/tmp"),
                pass_fds=(req_r, resp_w, flag_w) + (() if filter_fd is None else (filter_fd,)),
                start_new_session=True, preexec_fn=_make_preexec(limits, cpu, conf and conf.preexec))
            procs.append(cand)
            judge = subprocess.Popen(
                judge_cmd, cwd="/", stdin=subprocess.PIPE, stdout=out_w, stderr=out_w,
                env=dict(env, HOME="/nonexistent", TMPDIR="/nonexistent"),
                pass_fds=(req_w, resp_r, res_w) + (() if judge_filter is None else (judge_filter,)),
                start_new_session=True, preexec_fn=_make_preexec([lim for lim in limits
                                                                  if lim[0] != resource.RLIMIT_NPROC], cpu,
                                                                 jconf and jconf.preexec))
            procs.append(judge)
        except (OSError, subprocess.SubprocessError) as e:
            return SandboxResult(False, "error", time.monotonic() - t0, f"could not start the sandbox: {e}",
                                 isolation=iso)
        finally:
            for fd in child_fds:
                os.close(fd)
            for c in (conf, jconf):
                if c is not None:
                    c.close()
        for proc, payload in ((cand, code.encode("utf-8", "replace")),
                              (judge, token.encode() + b"\n" + tests.encode("utf-8", "replace"))):
            # from a thread: a child that never reads its stdin must not block us past the deadline
            threading.Thread(target=_feed, args=(proc.stdin, payload), daemon=True).start()
        clock = _Charged(t0, wall_s, timeout_s, cand.pid, judge.pid)
        if usage is not None:
            usage.pid = cand.pid
        out, verdict, over, timed_out = _collect(out_r, res_r, clock, max_output, usage)
        words = _verdict(verdict, token)
        try:  # the judge saw the candidate end: how it ended (a CPU-time kill is a timeout)
            cand_rc = cand.wait(timeout=1.0) if words is not None and "gone" in words else cand.poll()
        except subprocess.TimeoutExpired:
            cand_rc = None
        for p in procs:
            _kill_group(p)
        judge_rc = judge.wait()
        if cand_rc is None:
            cand.wait()
    finally:
        os.close(out_r)
        os.close(res_r)
        for p in procs:
            _kill_group(p)
            p.wait()
        flagged = _flagged(flag_r)
        duration = time.monotonic() - t0  # the run's time: removing its folder afterwards is the host's
        if cand_dir is not None:
            _remove_tree(cand_dir)
    text = out.decode("utf-8", "replace")
    detail = text[-DETAIL_CHARS:]
    if words is None and verdict and not timed_out and not over:
        # something other than the judge's one well-formed message on its channel: a failed run, counted
        with _LOCK:
            PROTOCOL_ERRORS[0] += 1
        return SandboxResult(False, "protocol", duration, detail or "verdict channel: not one verdict message",
                             True, iso, clock.waited)
    words = words or []
    blocked = flagged or "blocked" in words or "nonplain" in words
    if words[:1] == ["pass"] and judge_rc == 0 and not timed_out and not over:
        return SandboxResult(True, "passed", duration, detail, blocked, iso, clock.waited)
    cand_sig = _signal_of(cand_rc, iso == "bwrap")
    # SIGKILL after timeout_s or more of life is RLIMIT_CPU's hard limit (CPU time never exceeds wall time): a
    # timeout whether the machine was busy (the wall backstop came first) or quiet.
    cpu_kill = cand_sig == signal.SIGKILL and duration >= timeout_s
    if timed_out or cpu_kill or signal.SIGXCPU in (cand_sig, _signal_of(judge_rc, False)):
        status = "timeout"
    elif over:
        status = "disk_limit" if usage is not None and usage.over else "output_limit"
    elif "MemoryError" in text[-600:]:
        status = "memory"
    elif "nonplain" in words:
        status = "nonplain"
    elif "gone" in words:
        status = "killed" if cand_sig else "exited"
    elif blocked:
        status = "blocked"
    else:
        status = "failed"
    return SandboxResult(False, status, duration, detail or f"verdict {' '.join(words) or 'none'}", blocked, iso,
                         clock.waited)


_VERDICT = re.compile(r"mechdiag-verdict ([0-9a-f]{32}) (pass|fail (?:error|gone|nonplain))( blocked)?\n")
PROTOCOL_ERRORS = [0]  # runs whose verdict channel held anything but the judge's one message (this process)


def _verdict(raw: bytes, token: str) -> list[str] | None:
    """The words of the verdict channel's content when it is exactly one well-formed message of this run's judge
    (its token), else None (nothing, two messages, a forged or truncated one)."""
    m = _VERDICT.fullmatch(raw.decode("ascii", "replace"))
    if m is None or not secrets.compare_digest(m.group(1), token):
        return None
    return (m.group(2) + (m.group(3) or "")).split()


def _flagged(fd: int) -> bool:
    """Whether the guard wrote on its flag pipe (read without waiting; every writer is gone by now), and close it."""
    try:
        os.set_blocking(fd, False)
        return bool(os.read(fd, 16))
    except OSError:
        return False
    finally:
        os.close(fd)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def _remove_tree(path: str) -> None:
    """Remove a run's folder whatever the candidate built in it; never raises. shutil.rmtree first (it recurses:
    a tree deeper than Python's recursion limit raises RecursionError); then iteratively, by descriptors
    relative to each folder, never following a link, in time linear in the tree (`rm -rf` takes seconds on a
    chain of 1500 folders): a folder deeper than 64 levels is first moved up to the top, so no more than 64
    descriptors are open at once."""
    try:
        shutil.rmtree(path)
        return
    except FileNotFoundError:
        return
    except (OSError, RecursionError, MemoryError):
        pass
    try:
        top = os.open(path, _DIR_FLAGS)
    except OSError:
        return
    stack: list[list] = [[top, None, None, None]]  # [fd, parent fd, name, subfolders not yet removed]
    moved, rescan = 0, False
    while stack:
        frame = stack[-1]
        fd = frame[0]
        if frame[3] is None:
            frame[3] = []
            try:
                with os.scandir(fd) as it:
                    for e in it:
                        if e.is_dir(follow_symlinks=False):
                            frame[3].append(e.name)
                        else:
                            try:
                                os.unlink(e.name, dir_fd=fd)
                            except OSError:
                                pass
            except OSError:
                pass
        if frame[3]:
            name = frame[3].pop()
            if len(stack) >= 64:  # move it up to the top: depth costs no descriptors
                try:
                    os.rename(name, f".mechdiag-deep-{moved}", src_dir_fd=fd, dst_dir_fd=top)
                    moved, rescan = moved + 1, True
                except OSError:
                    pass
                continue
            try:
                stack.append([os.open(name, _DIR_FLAGS, dir_fd=fd), fd, name, None])
            except OSError:
                try:
                    os.rmdir(name, dir_fd=fd)
                except OSError:
                    pass
            continue
        if len(stack) == 1 and rescan:  # folders moved up since the top was listed
            frame[3], rescan = None, False
            continue
        stack.pop()
        os.close(fd)
        if frame[1] is not None:
            try:
                os.rmdir(frame[2], dir_fd=frame[1])
            except OSError:
                pass
    try:
        os.rmdir(path)
    except OSError:
        pass


def _signal_of(rc: int | None, bwrap: bool) -> int:
    """The signal that ended a process (bwrap reports its child's as 128 + signal), else 0."""
    if rc is None:
        return 0
    if rc < 0:
        return -rc
    return rc - 128 if bwrap and rc > 128 else 0


def _feed(stream, payload: bytes) -> None:
    try:
        stream.write(payload)
        stream.close()
    except (BrokenPipeError, OSError, ValueError):
        pass


class _Charged:
    """The run's clocks once the wall backstop is reached: the wall time charged is the elapsed time less the
    time the candidate and the judge waited for a CPU (/proc/PID/schedstat; a starved run is not a sleeper), up
    to STARVED_FACTOR backstops; the candidate's whole process tree is held to timeout_s + 1 CPU seconds
    (RLIMIT_CPU holds each process; this holds a tree that keeps starting fresh ones)."""

    def __init__(self, t0: float, wall_s: float, timeout_s: float, cand: int, judge: int):
        self.t0, self.wall_s, self.cpu_s, self.cand, self.judge = t0, wall_s, timeout_s + 1, cand, judge
        # a pinned tree uses at most one CPU second per second: nothing to measure before either limit can pass
        self.next, self.waited = t0 + min(wall_s, self.cpu_s), 0.0
        self.host0 = _own_wait()  # the host thread driving this run may be starved too (it reads and kills)

    def left(self) -> float:
        """Seconds until the next check (<= 0: the run is over its deadline)."""
        now = time.monotonic()
        if now < self.next:
            return self.next - now
        elapsed = now - self.t0
        if elapsed >= STARVED_FACTOR * self.wall_s:
            return 0.0
        tree = _tree(self.cand)
        cpu, waited = 0.0, 0.0
        for pid in tree:
            used, wait = _times(pid)
            cpu += used
            waited = max(waited, wait)  # the tree's processes wait side by side: its most starved one
        self.waited = min(waited + _times(self.judge)[1] + _own_wait() - self.host0, elapsed)
        if cpu > self.cpu_s or elapsed - self.waited >= self.wall_s:
            return 0.0
        self.next = now + min(1.0, max(0.25, self.wall_s - (elapsed - self.waited)))
        return self.next - now


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _times(pid: int) -> tuple[float, float]:
    """(CPU seconds used, with reaped children; seconds waited on a run queue) of a live process, else zeros."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        with open(f"/proc/{pid}/schedstat", "rb") as fh:
            wait = int(fh.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0, 0.0
    return sum(int(x) for x in fields[11:15]) / _TICK, wait


def _own_wait() -> float:
    """Seconds the calling thread has waited on a run queue."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as fh:
            return int(fh.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _tree(root: int) -> list[int]:
    """root, its live descendants (by parent pid, from /proc) and the rest of its process group (orphans a
    candidate left to init stay in it: the landlock mode refuses setsid and setpgid)."""
    children: dict[int, list[int]] = {}
    group = []
    try:
        names = os.listdir("/proc")
    except OSError:  # no procfs (macOS): the root alone, measured as zeros
        names = []
    for name in names:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as fh:
                    fields = fh.read().rsplit(b")", 1)[1].split()
                ppid, pgrp = int(fields[1]), int(fields[2])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
            if pgrp == root:
                group.append(int(name))
    out, todo = set(), [root, *group]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(children.get(pid, ()))
    return sorted(out)


class _FolderUsage:
    """The bytes a run's private folder holds on the host's disk, held to `cap` (the landlock and guard-only
    modes where the run cannot have a tmpfs of its own: the host checks every POLL_S while the run lives). Files
    the run unlinked but holds open count too: every OPEN_EVERY checks, the deleted files open in the
    candidate's process tree (/proc/PID/fd) are added (O_TMPFILE is refused by seccomp)."""

    POLL_S = 0.01
    OPEN_EVERY = 5

    def __init__(self, path: str, cap: int):
        self.path, self.cap, self.over, self.pid, self.checks, self.unlinked = path, cap, False, 0, 0, 0
        self.next_at = 0.0

    def check(self, force: bool = False) -> bool:
        """Whether the folder is over its cap (then it stays so); force: look now, and count the open deleted
        files. A scan that takes long (a tree of thousands of folders) spaces the next ones out: the host spends
        at most a quarter of its time scanning."""
        t0 = time.monotonic()
        if not force and t0 < self.next_at:
            return self.over
        self.checks += 1
        if self.pid and (force or self.checks % self.OPEN_EVERY == 0):
            self.unlinked = _open_unlinked(self.pid)
        total, stack = self.unlinked, [self.path]
        while stack and total <= self.cap:
            try:
                with os.scandir(stack.pop()) as it:
                    for e in it:
                        st = e.stat(follow_symlinks=False)
                        total += max(st.st_blocks * 512, 4096)  # an empty file or folder still costs an inode
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
            except OSError:  # removed while we looked, or unreadable: the rest still counts
                continue
        self.over = self.over or total > self.cap
        self.next_at = time.monotonic() + 3 * (time.monotonic() - t0)
        return self.over


def _open_unlinked(root: int) -> int:
    """Bytes of the deleted files open in the process tree of `root` (children from /proc/PID/task/*/children)."""
    total, seen, todo = 0, set(), [root]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
                    todo.extend(int(x) for x in fh.read().split())
            fds = os.listdir(f"/proc/{pid}/fd")
        except (OSError, ValueError):
            continue
        for fd in fds:
            link = f"/proc/{pid}/fd/{fd}"
            try:
                if os.readlink(link).endswith(" (deleted)"):
                    total += os.stat(link).st_blocks * 512
            except OSError:
                continue
    return total


def _collect(out_r: int, res_r: int, clock: _Charged, max_output: int, usage: _FolderUsage | None = None):
    """Read output (capped) and the judge's verdict until the verdict pipe closes or the deadline passes, or the
    private folder (`usage`) grows over its cap."""
    sel = selectors.DefaultSelector()
    sel.register(out_r, selectors.EVENT_READ, "out")
    sel.register(res_r, selectors.EVENT_READ, "res")
    out, res, total, over, timed_out, res_open = bytearray(), bytearray(), 0, False, False, True
    poll = 0.5 if usage is None else usage.POLL_S
    while res_open:
        left = clock.left()
        if left <= 0:
            timed_out = True
            break
        if usage is not None and usage.check():
            over = True
            break
        for key, _ in sel.select(timeout=min(left, poll)):
            chunk = os.read(key.fd, 65536)
            if key.data == "res":
                if not chunk:
                    sel.unregister(key.fd)
                    res_open = False
                res += chunk[: 4096 - len(res)]
                continue
            if not chunk:
                sel.unregister(key.fd)
                continue
            total += len(chunk)
            out += chunk
            if len(out) > 2 * DETAIL_CHARS * 4:
                del out[: len(out) - DETAIL_CHARS * 4]
            if total > max_output:
                over = True
        if over:
            break
    if usage is not None and not timed_out and not over and usage.check(force=True):
        over = True  # the last look, with the run's processes still holding their files: no pass past the cap
    if not timed_out and not over:  # output written just before the verdict
        drain = selectors.DefaultSelector()
        drain.register(out_r, selectors.EVENT_READ)
        while total <= max_output and drain.select(timeout=0):
            chunk = os.read(out_r, 65536)
            if not chunk:
                break
            out += chunk
            total += len(chunk)
        drain.close()
    sel.close()
    return bytes(out[-DETAIL_CHARS * 4:]), bytes(res), over, timed_out


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def cores() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def run_many(jobs: list[tuple], workers: int = 0, **kwargs) -> list[SandboxResult]:
    """Run many (code, tests) or (code, tests, entry_points) jobs, `workers` at a time (0: one per core); results in
    input order. Each run holds one core (its candidate and judge are pinned there, and the candidate may not
    change that), so a candidate that starts many busy threads or processes slows only itself."""
    if not jobs:
        return []
    own = cores()
    workers = workers or len(own)
    slots: queue.SimpleQueue = queue.SimpleQueue()
    for i in range(workers):
        slots.put(own[i % len(own)])

    def one(job):
        cpu = slots.get()
        try:
            return run_tests(job[0], job[1], entry_points=job[2] if len(job) > 2 else (), cpu=cpu, **kwargs)
        finally:
            slots.put(cpu)

    if workers <= 1 or len(jobs) == 1:
        return [one(job) for job in jobs]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, jobs))
