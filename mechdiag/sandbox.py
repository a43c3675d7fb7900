"""Run model-written code against trusted tests: the candidate runs isolated, the verdict comes from a judge.

Two processes per run, both started by the caller (the host):
- the candidate: `python -I -S -c CANDIDATE` inside bubblewrap (new user, pid, net, ipc, uts namespaces; the
  interpreter's prefix, /usr and /etc/localtime read-only; a private tmpfs as its work folder; no home, /root,
  host /tmp or project; --die-with-parent, --new-session), under rlimits, with the in-process guard (an audit
  hook) as a second layer. It executes the solution, then serves calls: it never sees the tests.
- the judge: a clean `python -I -S -c JUDGE` (outside bubblewrap: it runs only trusted test code on plain data;
  see docs/reliability.md) that executes the tests. Every name the tests take from the solution is a proxy: a
  call sends its arguments to the candidate and only plain data comes back (None, bool, int, float, complex,
  str, bytes; list, tuple, dict, set, frozenset nested), as tagged marshal frames validated type by type. Anything else
  comes back as an opaque reference the tests may only pass back, call, or get/set attributes of; using it as
  data (==, bool, hash, iter, str, ...) fails the test (status `nonplain`).
A pass is the judge's `pass` line on a pipe only the judge holds, and the judge's exit status 0.

Limits: CPU seconds (RLIMIT_CPU, the primary limit: a verdict does not depend on machine load), address space,
processes, file size, open files, no core; a wall-clock backstop WALL_FACTOR times longer (sleeping code).
Without a usable bwrap, code does not run (SandboxUnavailable) unless the user set sandbox: guard-only: then the
candidate runs under the guard alone (isolation() == "guard-only"), with a warning printed once per process.
"""

from __future__ import annotations

import errno
import itertools
import math
import os
import resource
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

from mechdiag.errors import UserError

MAX_OUTPUT = 1 << 20  # bytes of stdout+stderr read back before the run is killed
DETAIL_CHARS = 2000
WALL_FACTOR = 4.0  # wall-clock backstop = WALL_FACTOR * timeout_s (CPU seconds)
MAX_MESSAGE = 8 << 20  # bytes of one message between judge and candidate
TMP_BYTES = 64 << 20  # the candidate's one writable tmpfs (its /tmp), capped: host RAM outside RLIMIT_AS
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap) for OS isolation of model code"


@dataclass
class SandboxResult:
    passed: bool
    # passed | failed | timeout | memory | output_limit | nonplain | blocked | exited | killed | error
    status: str
    duration_s: float
    detail: str = ""
    blocked: bool = False  # the guard refused an operation, or the solution returned non-plain data
    isolation: str = ""  # bwrap | guard-only


class SandboxUnavailable(UserError):
    """sandbox: strict, and no OS isolation here."""


# Shared by both scripts: plain data as tagged lists in length-prefixed marshal frames (marshal is built in: no
# import cost; the judge checks every type it gets back, so marshal's own types never pass). Lists carry a tag
# first: L list, T tuple, S set, F frozenset, D dict (k, v, k, v...), B bytes, C complex (re, im), R an opaque
# reference (id), N a builtin by name (a test may pass `int`). `ref` encodes everything else.
CODEC = r'''
import marshal, os, sys
_PLAIN = (type(None), bool, int, float, str)
_SEQ = {list: "L", tuple: "T", set: "S", frozenset: "F"}
# A NaN keeps its identity across the boundary (Python's == on containers, `in` and count check identity first:
# [x] == [x] for x = nan): each side numbers the NaNs it sends (n: mine, k, value); one sent back is the
# receiver's own object (m: yours, k); math.nan and cmath's travel by name (K).
_MINE, _MINE_IDS, _THEIRS, _THEIRS_IDS = [], {}, {}, {}
_KNOWN = ("math.nan", "cmath.nan", "cmath.nanj")

def _nan(v):
    k = _THEIRS_IDS.get(id(v))
    if k is not None:
        return ["m", k]
    for name in _KNOWN:
        mod, _, attr = name.partition(".")
        if getattr(sys.modules.get(mod), attr, None) is v:
            return ["K", name]
    k = _MINE_IDS.get(id(v))
    if k is None:
        k = _MINE_IDS[id(v)] = len(_MINE)
        _MINE.append(v)
    return ["n", k, v]

def nan_of(tag, rest):
    """The object a NaN tag names; None when it is malformed."""
    if tag == "n" and len(rest) == 2 and type(rest[0]) is int and type(rest[1]) in (float, complex) and (
            rest[1] != rest[1]):
        if rest[0] not in _THEIRS:
            _THEIRS[rest[0]] = rest[1]
            _THEIRS_IDS[id(rest[1])] = rest[0]
        return _THEIRS[rest[0]]
    if tag == "m" and len(rest) == 1 and type(rest[0]) is int and 0 <= rest[0] < len(_MINE):
        return _MINE[rest[0]]
    if tag == "K" and len(rest) == 1 and rest[0] in _KNOWN:
        mod, _, attr = rest[0].partition(".")
        __import__(mod)
        return getattr(sys.modules[mod], attr)
    return None

def enc(v, ref):
    t = type(v)
    if (t is float or t is complex) and v != v:
        return _nan(v)
    if t in _PLAIN:
        return v
    tag = _SEQ.get(t)
    if tag is not None:
        return [tag] + [enc(x, ref) for x in v]
    if t is dict:
        out = ["D"]
        for k, x in v.items():
            out.append(enc(k, ref))
            out.append(enc(x, ref))
        return out
    if t is bytes:
        return ["B", v]
    if t is complex:
        return ["C", v.real, v.imag]
    return ref(v)

def dumps(v):
    data = marshal.dumps(v)
    return len(data).to_bytes(4, "big") + data

def read_exact(fd, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)

def read_frame(fd, limit):
    """The next frame's bytes; None at end of stream or when it is larger than limit."""
    head = read_exact(fd, 4)
    if head is None or int.from_bytes(head, "big") > limit:
        return None
    return read_exact(fd, int.from_bytes(head, "big"))
'''

# the candidate's first statement (and the probe's): a root start drops every uid, gid and group, which clears
# all capabilities; it stops when uid 0 remains
DROP = r'''
def _drop(uid):
    if uid != "-":
        u = int(uid)
        os.setgroups([])
        os.setresgid(u, u, u)
        os.setresuid(u, u, u)
    if os.geteuid() == 0 or os.getuid() == 0:
        os._exit(3)
'''

CANDIDATE = CODEC + DROP + r'''
import os, collections, types  # noqa: imported before the hook (types reads a traceback frame on import)

def _main():
    _drop(sys.argv[4])
    _read, _write, _exit = os.read, os.write, os._exit
    data = b""
    while True:
        chunk = _read(0, 1 << 20)
        if not chunk:
            break
        data += chunk
    os.close(0)
    code = data.decode("utf-8", "replace")
    del data
    req, resp = int(sys.argv[1]), int(sys.argv[2])
    root = os.getcwd()
    state = {"blocked": False}
    _builtins, _dict_items = dict(vars(__builtins__) if type(__builtins__) is dict else vars(__builtins__)), dict.items
    # exact stdlib dicts travel as the plain dict they hold (read with dict's own C iteration): compared with a
    # dict they are equal exactly when that dict is, so the verdict is the same and no method of theirs runs
    as_dict = (collections.Counter, collections.OrderedDict, collections.defaultdict)
    if sys.argv[3] == "guard":
        sys.addaudithook(_make_hook(root, state))
    refs = {}

    def ref(v):
        if type(v) in as_dict:
            return enc({k: x for k, x in _dict_items(v)}, ref)
        refs[len(refs) + 1] = v
        return ["R", len(refs)]

    def dec(x):
        t = type(x)
        if t is not list:
            return x
        tag, rest = x[0], x[1:]
        if tag == "R":
            return refs[rest[0]]
        if tag == "N":
            return _builtins[rest[0]]
        if tag == "D":
            return {dec(rest[i]): dec(rest[i + 1]) for i in range(0, len(rest), 2)}
        if tag == "B":
            return rest[0]
        if tag == "C":
            return complex(rest[0], rest[1])
        if tag in ("n", "m", "K"):
            return nan_of(tag, rest)
        return {"L": list, "T": tuple, "S": set, "F": frozenset}[tag](dec(v) for v in rest)

    g = {"__name__": "__main__", "__builtins__": __builtins__}
    load_error = None
    try:
        exec(compile(code, "solution.py", "exec"), g)
    except BaseException as e:
        load_error = e
    _describe = _describer()
    while True:
        frame = read_frame(req, 1 << 30)
        if frame is None:
            _exit(0)
        try:
            msg = marshal.loads(frame)
            if load_error is not None:
                raise load_error
            op = msg[0]
            if op == "names":
                out = []
                for name in msg[1]:
                    if name in g:
                        out.append([name] + _describe(g[name], ref))
                value = out
            elif op == "call":
                value = enc(refs[msg[1]](*dec(msg[2]), **dec(msg[3])), ref)
            elif op == "getattr":
                value = enc(getattr(refs[msg[1]], msg[2]), ref)
            elif op == "setattr":
                setattr(refs[msg[1]], msg[2], dec(msg[3]))
                value = None
            else:
                raise ValueError("unknown request")
            reply = ["ok", value]
        except BaseException as e:
            try:
                reply = ["err", type(e).__name__, str(e)[:500]]
            except BaseException:
                reply = ["err", "Exception", "unprintable exception"]
        try:
            out = dumps(reply + [state["blocked"]])
        except BaseException as e:
            out = dumps(["err", type(e).__name__, "result could not be sent", state["blocked"]])
        for stream in (sys.stdout, sys.stderr):  # the solution's prints, before the judge may end the run
            try:
                stream.flush()
            except BaseException:
                pass
        view = memoryview(out)
        while view:
            view = view[_write(resp, view):]


def _describer():
    """How a name the tests use travels: plain data or a reference; a module or a stdlib object also says its
    name, so that the judge can use its own copy where that is safe (see PURE in the judge)."""
    _stdlib, _type, _getattr, _str = frozenset(sys.stdlib_module_names), type, getattr, str
    _module = types.ModuleType

    def describe(v, ref):
        if _type(v) is _module:
            return ["module", _str(v.__name__), enc(v, ref)]
        mod, qual = _getattr(v, "__module__", None), _getattr(v, "__qualname__", None)
        if callable(v) and _type(mod) is _str and _type(qual) is _str and (mod.split(".")[0] in _stdlib
                                                                           or mod == "builtins"):
            return ["stdlib", mod, qual, enc(v, ref)]
        return ["value", enc(v, ref)]
    return describe


def _make_hook(root, state):
    _getcwd, _str, _bytes, _int = os.getcwd, str, bytes, int
    allow_read = tuple(p.rstrip("/") + "/" for p in {sys.prefix, sys.base_prefix, sys.exec_prefix,
                       sys.base_exec_prefix, "/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/share",
                       "/usr/local/lib"}) + (root + "/",)
    allow_files = ("/dev/null", "/dev/urandom", "/dev/zero", "/etc/localtime", root)
    O_WRITE = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    BLOCK = frozenset("""os.fork os.forkpty os.posix_spawn os.spawn os.exec os.system os.kill os.killpg
        signal.pthread_kill subprocess.Popen pty.spawn socket.__new__ socket.connect socket.bind socket.getaddrinfo
        socket.gethostbyname socket.gethostbyaddr socket.sendto ctypes.dlopen ctypes.dlsym ctypes.cdata
        ctypes.call_function sys.settrace sys.setprofile sys._current_frames gc.get_objects gc.get_referrers
        gc.get_referents resource.setrlimit resource.prlimit os.chroot os.setuid os.setgid os.symlink os.link
        os.chown os.posix_fadvise os.mknod os.setxattr os.removexattr webbrowser.open urllib.Request""".split())
    BLOCK_IMPORT = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "cffi", "_cffi_backend", "multiprocessing",
                              "_multiprocessing", "pty"})
    FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
    PATH_EVENTS = {"os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)), "os.mkdir": ((0,), (2,)),
                   "os.rename": ((0, 1), (2, 3)), "os.chmod": ((0,), (2,)), "os.truncate": ((0,), ()),
                   "os.utime": ((0,), (3,)), "shutil.rmtree": ((0,), (1,)), "os.chflags": ((0,), ())}

    def norm(p):
        if type(p) is _bytes:
            p = p.decode("utf-8", "surrogateescape")
        if type(p) is not _str:
            return None
        if not p.startswith("/"):
            p = _getcwd() + "/" + p
        parts = []
        for part in p.split("/"):
            if part in ("", "."):
                continue
            if part == "..":
                if parts:
                    parts.pop()
            else:
                parts.append(part)
        return "/" + "/".join(parts)

    _stat, _S_ISDIR = os.stat, __import__("stat").S_ISDIR

    def isdir(p):
        try:
            return _S_ISDIR(_stat(p).st_mode)
        except (OSError, ValueError):
            return False

    def inside(p):
        return p is not None and (p == root or p.startswith(root + "/"))

    def deny(event):
        state["blocked"] = True
        raise PermissionError("sandbox: " + event + " is not allowed")

    def hook(event, args):
        if event in BLOCK:
            deny(event)
        if event == "open":
            path, mode, flags = args
            if type(path) is _int:
                return
            p = norm(path)
            writing = (any(c in mode for c in "wax+") if type(mode) is _str else
                       (type(flags) is _int and flags & O_WRITE != 0))
            if mode is None and not inside(p) and isdir(p):
                deny("os.open of a folder outside the working folder")  # its fd could serve as a dir_fd
            if writing:
                if not inside(p):
                    deny("writing outside the working folder")
            elif p is None or not (p in allow_files or p.startswith(allow_read)):
                deny("reading " + _str(path))
        elif event in PATH_EVENTS:
            paths, dirfds = PATH_EVENTS[event]
            if any(i < len(args) and args[i] is not None and args[i] != -1 for i in dirfds):  # -1: no dir_fd
                deny(event + " with dir_fd")
            for i in paths:
                if i < len(args) and not (event == "os.truncate" and type(args[i]) is _int):
                    if not inside(norm(args[i])):
                        deny(event + " outside the working folder")
        elif event in ("os.listdir", "os.scandir"):  # listing is reading: the same folders
            if type(args[0]) is not _int:
                p = norm("." if args[0] is None else args[0])
                if p is None or not (inside(p) or (p + "/").startswith(allow_read)):
                    deny("listing " + _str(args[0]))
        elif event == "import":
            if args[0] in BLOCK_IMPORT or args[0].split(".")[0] in BLOCK_IMPORT:
                deny("import " + args[0])
        elif event == "sys._getframe":
            raise ValueError("sandbox: frame introspection is not allowed")
        elif event == "object.__getattr__" and args[1] in FRAME_ATTRS:
            deny("frame access")
    return hook

_main()
'''

JUDGE = CODEC + r'''
import builtins

class CandidateGone(BaseException):
    """The candidate process ended or broke the protocol: no test after this can pass."""

class CandidateError(Exception):
    """An exception the solution raised (of a kind that is not a builtin exception)."""

class NonPlainData(TypeError):
    pass

NONPLAIN = []  # set when a test used a candidate's object as data
BLOCKED = []

def _refuse(name):
    def method(self, *a, **k):
        NONPLAIN.append(name)
        raise NonPlainData("the solution returned an object that is not plain data (" + name + ")")
    return method

class Remote:
    """A candidate's object: it can be called, passed back, and have attributes read and set. Nothing else."""
    __slots__ = ("_id",)

    def __init__(self, i):
        object.__setattr__(self, "_id", i)

    def __call__(self, *args, **kwargs):
        return request(["call", self._id, send(list(args)), send(kwargs)])

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return request(["getattr", self._id, name])

    def __setattr__(self, name, value):
        request(["setattr", self._id, name, send(value)])

    def __repr__(self):
        return "<solution object>"

for _name in ("__eq__ __ne__ __lt__ __le__ __gt__ __ge__ __bool__ __hash__ __len__ __iter__ __contains__ "
              "__getitem__ __str__ __format__ __int__ __float__ __index__ __complex__ __bytes__ __add__ __radd__ "
              "__sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __mod__ __neg__ __abs__ __round__").split():
    setattr(Remote, _name, _refuse(_name))

def send(v):
    def ref(x):
        if type(x) is Remote:
            return ["R", object.__getattribute__(x, "_id")]
        name = getattr(x, "__name__", None)
        if type(name) is str and getattr(builtins, name, None) is x:
            return ["N", name]
        raise TypeError("a test argument of type " + type(x).__name__ + " cannot be sent to the solution")
    out = enc(v, ref)
    return out

def dec(x):
    """Plain data from the candidate, type by type; anything else breaks the protocol."""
    t = type(x)
    if x is None or t is bool or t is int or t is float or t is str:
        return x
    if t is not list or not x or type(x[0]) is not str:
        raise CandidateGone("malformed data from the solution")
    tag, rest = x[0], x[1:]
    if tag == "L":
        return [dec(v) for v in rest]
    if tag == "T":
        return tuple(dec(v) for v in rest)
    if tag == "S":
        return set(dec(v) for v in rest)
    if tag == "F":
        return frozenset(dec(v) for v in rest)
    if tag == "D" and len(rest) % 2 == 0:
        return {dec(rest[i]): dec(rest[i + 1]) for i in range(0, len(rest), 2)}
    if tag == "B" and len(rest) == 1 and type(rest[0]) is bytes:
        return rest[0]
    if tag == "C" and len(rest) == 2 and all(type(v) is float for v in rest):
        return complex(float(rest[0]), float(rest[1]))
    if tag == "R" and len(rest) == 1 and type(rest[0]) is int:
        return Remote(rest[0])
    if tag in ("n", "m", "K"):
        v = nan_of(tag, rest)
        if v is not None:
            return v
    raise CandidateGone("malformed data from the solution")

REQ = RESP = None

def request(msg):
    try:
        os.write(REQ, dumps(msg))
    except OSError:
        raise CandidateGone("the solution's process ended") from None
    frame = read_frame(RESP, MAX)
    if frame is None:
        raise CandidateGone("the solution's process ended, or its reply was too large")
    try:
        reply = marshal.loads(frame)
    except (ValueError, TypeError, EOFError, RecursionError):
        raise CandidateGone("malformed reply from the solution") from None
    if type(reply) is not list or len(reply) < 2:
        raise CandidateGone("malformed reply from the solution")
    ok, blocked = reply[0], reply[-1]
    if blocked is True:
        BLOCKED.append(1)
    if ok == "ok" and len(reply) == 3:
        try:
            return dec(reply[1]) if msg[0] != "names" else reply[1]
        except (TypeError, ValueError, RecursionError) as e:
            raise NonPlainData("data from the solution rejected: " + str(e)) from None
    if ok == "err" and len(reply) == 4 and type(reply[1]) is str and type(reply[2]) is str:
        kind = getattr(builtins, reply[1], None)
        # StopIteration would end the test's own iteration (all(map(f, xs)) stops early and passes): plain failure
        if not (isinstance(kind, type) and issubclass(kind, Exception)) or issubclass(
                kind, (StopIteration, StopAsyncIteration)):
            kind = CandidateError
        raise kind("from the solution: " + reply[1] + ": " + reply[2])
    raise CandidateGone("malformed reply from the solution")

# Modules whose objects the judge may use in place of the solution's (patching them in the candidate then changes
# nothing): pure computation, no files, processes or I/O. Anything else the tests take from the solution stays a
# proxy to the solution's object, so a solution cannot make the judge call, say, os.system with test arguments.
PURE = frozenset("""math cmath re collections itertools functools operator heapq bisect string statistics fractions
    decimal copy datetime calendar numbers typing enum array struct textwrap unicodedata random difflib""".split())
PURE_BUILTINS = frozenset("""abs all any ascii bin bool bytearray bytes chr complex dict divmod enumerate filter
    float format frozenset hash hex int isinstance issubclass iter len list map max min next oct ord pow range
    repr reversed round set slice sorted str sum tuple type zip""".split())

def resolve(module, qualname):
    """The judge's own object for module.qualname when that is pure, else None."""
    if module == "builtins":
        return getattr(builtins, qualname) if qualname in PURE_BUILTINS else None
    if module.lstrip("_").split(".")[0] not in PURE:
        return None
    obj = load(module)
    for part in qualname.split("."):
        if part.startswith("_") or part == "<locals>":
            return None
        obj = getattr(obj, part, None)
    return obj

def load(module):
    __import__(module)
    return sys.modules[module]

# a standard module name the tests use without importing it (MBPP 596 uses sys) is a fresh import of the judge's,
# never the solution's object of that name; modules with effects on import are left out
STANDARD = frozenset(n for n in sys.stdlib_module_names if not n.startswith("_")) - {"this", "antigravity"}

class Standard(dict):
    """The tests' builtins: the builtins, and a standard module on first use of its name."""

    def __missing__(self, name):
        if name in STANDARD:
            self[name] = load(name)
            return self[name]
        raise KeyError(name)

def main():
    global REQ, RESP, MAX
    data = b""
    while True:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            break
        data += chunk
    os.close(0)
    tests = data.decode("utf-8", "replace")
    REQ, RESP, res = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    MAX, entry = int(sys.argv[4]), set(filter(None, sys.argv[5].split(",")))
    outcome = "fail error"
    sys.stdout.reconfigure(line_buffering=True)  # the tests' prints come before the judge's last word
    try:
        code = compile(tests, "tests.py", "exec")
        used, todo = set(), [code]
        while todo:  # every global (and attribute) name the tests' code objects use: a superset is harmless
            c = todo.pop()
            used.update(c.co_names)
            todo.extend(k for k in c.co_consts if type(k) is type(code))
        # a solution's name that shadows a builtin is taken only when the caller names it an entry point:
        # else `set = lambda x: 0` would rig `set(f(x)) == set(expected)`
        wanted = [n for n in used if n in entry or not (hasattr(builtins, n) or n in STANDARD)]
        g = {"__name__": "__main__", "__builtins__": Standard(vars(builtins))}
        for item in request(["names", sorted(wanted)]):
            if type(item) is not list or len(item) < 3 or not all(type(x) is str for x in item[:2]):
                raise CandidateGone("malformed reply from the solution")
            name, kind = item[0], item[1]
            if name not in wanted:
                raise CandidateGone("malformed reply from the solution")
            if kind == "module" and len(item) == 4:
                own = load(item[2]) if type(item[2]) is str and item[2] in PURE else None
                g[name] = own if own is not None else dec(item[3])
            elif kind == "stdlib" and len(item) == 5 and type(item[2]) is str and type(item[3]) is str:
                own = resolve(item[2], item[3])
                g[name] = own if own is not None else dec(item[4])
            elif kind == "value":
                g[name] = dec(item[2])
            else:
                raise CandidateGone("malformed reply from the solution")
        exec(code, g)
        outcome = "pass"
    except CandidateGone as e:
        outcome = "fail gone"
        sys.stderr.write("\n[judge] " + str(e) + "\n")
    except BaseException as e:
        outcome = "fail " + ("nonplain" if NONPLAIN else "error")
        sys.stderr.write("\n[judge] " + type(e).__name__ + ": " + str(e)[:500] + "\n")
    if NONPLAIN and outcome == "pass":
        outcome = "fail nonplain"  # a test swallowed the refusal: still not a pass
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.write(res, (outcome + (" blocked" if BLOCKED else "") + "\n").encode())
    os._exit(0)

main()
'''


def _limits(timeout_s: float, memory_mb: int, max_procs: int, max_file_mb: int) -> list[tuple[int, int, int]]:
    cpu = int(math.ceil(timeout_s))
    mem = int(memory_mb) * 1024 * 1024
    fsize = int(max_file_mb) * 1024 * 1024
    return [(resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, mem, mem),
            (resource.RLIMIT_NPROC, max_procs, max_procs), (resource.RLIMIT_FSIZE, fsize, fsize),
            (resource.RLIMIT_NOFILE, 64, 64), (resource.RLIMIT_CORE, 0, 0)]


def _make_preexec(limits):
    setrlimit, getrlimit = resource.setrlimit, resource.getrlimit

    def preexec():  # runs in the child between fork and exec: C calls only, nothing imported here
        for which, soft, hard in limits:
            try:
                setrlimit(which, (soft, hard))
            except (ValueError, OSError):  # hard limit already lower here, or a limit this OS lacks
                try:
                    setrlimit(which, (min(soft, getrlimit(which)[1]), getrlimit(which)[1]))
                except (ValueError, OSError):
                    pass

    return preexec


def _python() -> str:
    """The real interpreter behind sys.executable (a venv's python is a link to it)."""
    return os.path.realpath(sys.executable)


def _bwrap_args(bwrap: str) -> list[str]:
    # as root, no user namespace (its uid 65534 would map to host uid 0): the candidate drops to a uid of its own
    # first thing (see CANDIDATE); as a user, a user namespace mapping 65534 to that user
    user = [] if os.geteuid() == 0 else ["--unshare-user", "--uid", "65534", "--gid", "65534"]
    args = [bwrap, *user, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session",
            "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    prefixes = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix,
                                               os.path.dirname(os.path.dirname(_python())))}
    for p in sorted(prefixes):
        if not (p == "/usr" or p.startswith("/usr/")):
            parts = p.strip("/").split("/")
            for i in range(1, len(parts)):  # bwrap makes missing parents 0700: the dropped uid must pass them
                args += ["--perms", "0755", "--dir", "/" + "/".join(parts[:i])]
            args += ["--ro-bind", p, p]
    # /proc read-only (no sysctl writes); /dev a read-only folder of three devices (no /dev/shm: POSIX shared
    # memory has nowhere to live); /tmp the one writable tmpfs, capped
    args += ["--ro-bind-try", "/etc/localtime", "/etc/localtime", "--proc", "/proc", "--remount-ro", "/proc",
             "--size", str(64 << 10), "--tmpfs", "/dev"]
    for dev in ("null", "zero", "urandom"):
        args += ["--dev-bind", f"/dev/{dev}", f"/dev/{dev}"]
    args += ["--symlink", "/proc/self/fd", "/dev/fd", "--remount-ro", "/dev",
             "--perms", "1777", "--size", str(TMP_BYTES), "--tmpfs", "/tmp", "--remount-ro", "/", "--chdir", "/tmp",
             "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp", "--"]
    return args


# syscalls no test needs, refused (EPERM) by a seccomp filter bwrap installs before it starts the candidate:
# tracing and reading other processes, namespaces and mounts, the kernel keyring, eBPF, perf, io_uring, modules
SECCOMP_DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "setns",
                  "unshare", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
                  "io_uring_setup", "io_uring_enter", "io_uring_register", "init_module", "finit_module",
                  "delete_module", "kexec_load", "kexec_file_load", "open_by_handle_at")
_SECCOMP: list[bytes | None] = []
_SECCOMP_LOCK = threading.Lock()


def seccomp_program() -> bytes | None:
    """The filter's BPF program (libseccomp through pyseccomp; syscalls of another architecture kill the
    process); None where pyseccomp or libseccomp is not installed (the `sandbox` extra)."""
    with _SECCOMP_LOCK:
        if not _SECCOMP:
            try:
                import pyseccomp  # noqa: PLC0415 - optional (the sandbox extra), loaded where bwrap runs
            except (ImportError, OSError):
                _SECCOMP.append(None)
                return None
            f = pyseccomp.SyscallFilter(defaction=pyseccomp.ALLOW)
            for name in SECCOMP_DENIED:
                f.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
            with tempfile.TemporaryFile() as fh:
                f.export_bpf(fh)
                fh.seek(0)
                _SECCOMP.append(fh.read())
        return _SECCOMP[0]


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


_ISOLATION: str | None = None
_MODE = "auto"
_WARNED = False
_LOCK = threading.Lock()


def isolation() -> str:
    """The isolation model code can get in this process: 'bwrap' (OS namespaces + guard) or 'guard-only' (audit
    hook only, run only when the user asked for sandbox: guard-only). Probed once: bwrap on PATH and able to
    start the interpreter in its namespaces, as the candidate's dropped uid."""
    global _ISOLATION
    with _LOCK:
        if _ISOLATION is None:
            _ISOLATION = "guard-only"
            bwrap = shutil.which("bwrap")
            if bwrap and sys.platform.startswith("linux"):
                args = _bwrap_args(bwrap)
                fd = _seccomp_fd(args)
                try:
                    probe = subprocess.run(args + [
                        _python(), "-I", "-S", "-c", "import os\n" + DROP + "_drop(os.sys.argv[1])\nprint('ok')",
                        _candidate_uid()],
                                           capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
                                           cwd="/", pass_fds=() if fd is None else (fd,))
                    if probe.returncode == 0 and probe.stdout.strip() == "ok":
                        _ISOLATION = "bwrap"
                except (OSError, subprocess.SubprocessError):
                    pass
                finally:
                    if fd is not None:
                        os.close(fd)
        return _ISOLATION


MODES = ("auto", "strict", "guard-only")


def use(mode: str) -> str:
    """Set the policy and return the isolation in force. 'auto' and 'strict' need OS isolation (bwrap) and raise
    SandboxUnavailable without it: model code never runs unisolated by default. 'guard-only' is the weaker mode,
    named by the user: the in-process guard alone where bwrap cannot run (with a warning)."""
    global _MODE
    if mode not in MODES:
        raise UserError(f"sandbox must be one of {', '.join(MODES)}, got {mode!r}")
    _MODE = mode
    return _check()


def _check() -> str:
    global _WARNED
    iso = isolation()
    if iso != "bwrap":
        if _MODE != "guard-only":
            raise SandboxUnavailable(f"sandbox: {_MODE}, but bubblewrap cannot be used here, and model code does "
                                     f"not run without OS isolation; {INSTALL_HINT}, or set sandbox: guard-only "
                                     f"to run it under the in-process guard alone")
        with _LOCK:
            if not _WARNED:
                _WARNED = True
                print(f"mechdiag: warning: sandbox: guard-only: model code runs under the in-process guard only "
                      f"(no OS isolation); {INSTALL_HINT}", file=sys.stderr, flush=True)
    elif seccomp_program() is None:
        with _LOCK:
            if not _WARNED:
                _WARNED = True
                print("mechdiag: warning: pyseccomp or libseccomp2 is missing: bubblewrap runs model code without "
                      "its seccomp filter; pip install 'mechdiag[sandbox]' (and apt-get install libseccomp2)",
                      file=sys.stderr, flush=True)
    return iso


def run_tests(code: str, tests: str, timeout_s: float = 5.0, memory_mb: int = 512, max_procs: int = 16,
              max_file_mb: int = 8, max_output: int = MAX_OUTPUT, wall_s: float | None = None,
              entry_points: tuple[str, ...] | list[str] = ()) -> SandboxResult:
    """Run `code` in the sandbox and `tests` (trusted) in a judge that reaches the code through proxies.

    timeout_s: CPU seconds, for each of the candidate and the judge; wall_s: the wall-clock backstop (default
    WALL_FACTOR * timeout_s). entry_points: solution names the tests may take even where they shadow a builtin.
    """
    return _run(code, tests, timeout_s, memory_mb, max_procs, max_file_mb, max_output,
                WALL_FACTOR * timeout_s if wall_s is None else wall_s, tuple(entry_points), _check())


def _run(code, tests, timeout_s, memory_mb, max_procs, max_file_mb, max_output, wall_s, entry, iso,
         guard: bool = True) -> SandboxResult:
    t0 = time.monotonic()
    limits = _limits(timeout_s, memory_mb, max_procs, max_file_mb)
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    res_r, res_w = os.pipe()
    out_r, out_w = os.pipe()
    judge_dir = tempfile.mkdtemp(prefix="mechdiag-judge-")
    cand_dir = None if iso == "bwrap" else tempfile.mkdtemp(prefix="mechdiag-sbx-")
    uid = _candidate_uid()
    if cand_dir is not None and uid != "-":
        os.chown(cand_dir, int(uid), int(uid))  # the candidate's own folder, writable by its uid
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    python = _python()
    cand_cmd = [python, "-I", "-S", "-c", CANDIDATE, str(req_r), str(resp_w), "guard" if guard else "none", uid]
    filter_fd = None
    if iso == "bwrap":
        args = _bwrap_args(shutil.which("bwrap") or "bwrap")
        filter_fd = _seccomp_fd(args)
        cand_cmd = args + cand_cmd
    procs: list[subprocess.Popen] = []
    child_fds = (req_r, req_w, resp_r, resp_w, res_w, out_w) + (() if filter_fd is None else (filter_fd,))
    try:
        try:
            cand = subprocess.Popen(
                cand_cmd, cwd=cand_dir or judge_dir, stdin=subprocess.PIPE, stdout=out_w, stderr=out_w,
                env=dict(env, HOME=cand_dir or "/tmp", TMPDIR=cand_dir or "/tmp"),
                pass_fds=(req_r, resp_w) + (() if filter_fd is None else (filter_fd,)),
                start_new_session=True, preexec_fn=_make_preexec(limits))
            procs.append(cand)
            judge = subprocess.Popen(
                [python, "-I", "-S", "-c", JUDGE, str(req_w), str(resp_r), str(res_w), str(MAX_MESSAGE),
                 ",".join(entry)], cwd=judge_dir, stdin=subprocess.PIPE, stdout=out_w, stderr=out_w,
                env=dict(env, HOME=judge_dir, TMPDIR=judge_dir), pass_fds=(req_w, resp_r, res_w),
                start_new_session=True, preexec_fn=_make_preexec([lim for lim in limits
                                                                  if lim[0] != resource.RLIMIT_NPROC]))
            procs.append(judge)
        except (OSError, subprocess.SubprocessError) as e:
            return SandboxResult(False, "error", time.monotonic() - t0, f"could not start the sandbox: {e}",
                                 isolation=iso)
        finally:
            for fd in child_fds:
                os.close(fd)
        for proc, payload in ((cand, code), (judge, tests)):
            # from a thread: a child that never reads its stdin must not block us past the deadline
            threading.Thread(target=_feed, args=(proc.stdin, payload.encode("utf-8", "replace")),
                             daemon=True).start()
        out, verdict, over, timed_out = _collect(out_r, res_r, t0 + wall_s, max_output)
        try:  # the judge saw the candidate end: how it ended (a CPU-time kill is a timeout)
            cand_rc = cand.wait(timeout=1.0) if b"gone" in verdict else cand.poll()
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
        for d in (judge_dir, cand_dir):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)
    duration = time.monotonic() - t0
    text = out.decode("utf-8", "replace")
    detail = text[-DETAIL_CHARS:]
    words = verdict.decode("ascii", "replace").split()
    blocked = "blocked" in words or "nonplain" in words
    if words[:1] == ["pass"] and judge_rc == 0 and not timed_out and not over:
        return SandboxResult(True, "passed", duration, detail, blocked, iso)
    cand_sig = _signal_of(cand_rc, iso == "bwrap")
    # SIGKILL after timeout_s or more of life is RLIMIT_CPU's hard limit (CPU time never exceeds wall time): a
    # timeout whether the machine was busy (the wall backstop came first) or quiet.
    cpu_kill = cand_sig == signal.SIGKILL and duration >= timeout_s
    if timed_out or cpu_kill or signal.SIGXCPU in (cand_sig, _signal_of(judge_rc, False)):
        status = "timeout"
    elif over:
        status = "output_limit"
    elif "MemoryError" in text[-600:]:
        status = "memory"
    elif "nonplain" in words:
        status = "nonplain"
    elif "gone" in words:
        status = "killed" if cand_sig else "exited"
    elif "blocked" in words:
        status = "blocked"
    else:
        status = "failed"
    return SandboxResult(False, status, duration, detail or f"verdict {' '.join(words) or 'none'}", blocked, iso)


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


def _collect(out_r: int, res_r: int, deadline: float, max_output: int):
    """Read output (capped) and the judge's verdict until the verdict pipe closes or the deadline passes."""
    sel = selectors.DefaultSelector()
    sel.register(out_r, selectors.EVENT_READ, "out")
    sel.register(res_r, selectors.EVENT_READ, "res")
    out, res, total, over, timed_out, res_open = bytearray(), bytearray(), 0, False, False, True
    while res_open:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for key, _ in sel.select(timeout=min(left, 0.5)):
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


def run_many(jobs: list[tuple], workers: int = 2, **kwargs) -> list[SandboxResult]:
    """Run many (code, tests) or (code, tests, entry_points) jobs, `workers` at a time; results in input order."""
    def one(job):
        return run_tests(job[0], job[1], entry_points=job[2] if len(job) > 2 else (), **kwargs)

    if not jobs:
        return []
    if workers <= 1 or len(jobs) == 1:
        return [one(job) for job in jobs]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, jobs))
