"""Run model-written code against tests in a separate, limited process.

Layers (each one alone would not be enough):
1. A fresh process of the same Python (`sys.executable -I -S`: no site, no user env) in its own session, started
   in a temporary folder that is removed afterwards, with a scrubbed environment.
2. Kernel limits set before exec (preexec): CPU seconds, address space, process count, file size, open files,
   no core dumps; and a private network namespace (unshare(CLONE_NEWNET)) where the OS allows it.
3. A wall-clock deadline that SIGKILLs the whole process group, and a cap on the output read back.
4. Inside the child, before the untrusted code runs, an audit hook (sys.addaudithook, which cannot be removed)
   refuses process creation, signals, sockets, ctypes, tracing, frame/GC introspection, writes or deletes
   outside the working folder, and reads outside the Python installation and system library folders.

Pass protocol: the parent sends a random nonce on stdin; the harness reads it before running anything, then runs
the solution and the tests, and writes the nonce to a dedicated pipe (fd number in argv[1]) only when every
statement of the tests ran without an exception. A pass needs the nonce AND exit status 0; the exit status
alone never counts.
Limits of the design are listed in docs/reliability.md.
"""

from __future__ import annotations

import ctypes
import math
import os
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

CLONE_NEWNET = 0x40000000
MAX_OUTPUT = 1 << 20  # bytes of stdout+stderr read back before the run is killed
DETAIL_CHARS = 2000

try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
    _UNSHARE = _LIBC.unshare
except (OSError, AttributeError):  # not Linux / no libc symbol: the audit hook alone blocks sockets
    _UNSHARE = None


@dataclass
class SandboxResult:
    passed: bool
    status: str  # passed | failed | timeout | memory | output_limit | no_nonce | killed | error
    duration_s: float
    detail: str = ""


# The harness: trusted code that runs in the child before the solution. Kept dependency-free (no site, no json).
HARNESS = r'''
import os, sys
import ast, collections, types  # noqa: imported before the hook (types reads a traceback frame on import)

def _guard_asserts(tests):
    """Wrap every value an assert looks at in __sbx_plain__, so custom objects with a rigged __eq__/__bool__
    (an 'always equal' return value) fail instead of passing."""
    tree = ast.parse(tests, "tests.py")

    def wrap(e):
        if isinstance(e, ast.Compare):
            e.left = wrap_value(e.left)
            e.comparators = [wrap_value(c) for c in e.comparators]
            return e
        if isinstance(e, ast.BoolOp):
            e.values = [wrap(v) for v in e.values]
            return e
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            e.operand = wrap(e.operand)
            return e
        return wrap_value(e)

    def wrap_value(e):
        return ast.Call(func=ast.Name("__sbx_plain__", ast.Load()), args=[e], keywords=[])

    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            node.test = wrap(node.test)
    return ast.fix_missing_locations(tree)

def _known_types():
    seen, todo = set(), [object]
    while todo:
        t = todo.pop()
        if t not in seen:
            seen.add(t)
            try:
                todo.extend(type.__subclasses__(t))
            except TypeError:
                pass
    return seen

def _main():
    _read, _write, _exit, _close = os.read, os.write, os._exit, os.close
    data = b""
    while True:
        chunk = _read(0, 1 << 20)
        if not chunk:
            break
        data += chunk
    _close(0)
    head, _, rest = data.partition(b"\n")
    del data
    n_nonce, n_code = (int(x) for x in head.split())
    nonce, code, tests = rest[:n_nonce], rest[n_nonce:n_nonce + n_code].decode(), rest[n_nonce + n_code:].decode()
    del rest
    root, res_fd = os.getcwd(), int(sys.argv[1])
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
        os.chown os.posix_fadvise webbrowser.open urllib.Request""".split())
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
        elif event == "import":
            if args[0] in BLOCK_IMPORT or args[0].split(".")[0] in BLOCK_IMPORT:
                deny("import " + args[0])
        elif event == "sys._getframe":
            raise ValueError("sandbox: frame introspection is not allowed")
        elif event == "object.__getattr__" and args[1] in FRAME_ATTRS:
            deny("frame access")

    known, HEAP, _type, _isinstance = frozenset(_known_types()), 1 << 9, type, isinstance
    _list, _tuple, _set, _frozenset, _dict = list, tuple, set, frozenset, dict

    def plain(x):
        """x itself when it and everything inside it are of types that existed before the solution ran."""
        todo, budget = [x], 100000
        while todo and budget:
            v = todo.pop()
            budget -= 1
            t = _type(v)
            if t.__flags__ & HEAP and t not in known:
                raise AssertionError("sandbox: the test compared an object of a class made by the solution")
            if t in (_list, _tuple, _set, _frozenset):
                todo.extend(v)
            elif t is _dict:
                todo.extend(v.keys())
                todo.extend(v.values())
        return x

    _compile, _exec = compile, exec
    try:
        tests_tree = _guard_asserts(tests)
    except SyntaxError as e:
        _write(2, ("[harness] tests do not parse: " + _str(e)).encode())
        _exit(2)
    def flush():  # the solution's prints are buffered; os._exit would drop them
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass

    sys.addaudithook(hook)
    g = {"__name__": "__solution__", "__builtins__": __builtins__}
    try:
        _exec(_compile(code, "solution.py", "exec"), g)
        tg = _dict(g)  # the tests get their own globals: the solution cannot reach __sbx_plain__ to replace it
        tg["__sbx_plain__"] = plain
        _exec(_compile(tests_tree, "tests.py", "exec"), tg)
    except BaseException as e:
        try:
            msg = type(e).__name__ + ": " + _str(e)
        except BaseException:
            msg = "unprintable exception"
        try:
            flush()
            _write(2, ("\n[harness] " + msg[:500] + "\n").encode("utf-8", "replace"))
        finally:
            _exit(1)
    flush()
    _write(res_fd, nonce + b"\n")
    _exit(0)
_main()
'''


def _limits(timeout_s: float, memory_mb: int, max_procs: int, max_file_mb: int) -> list[tuple[int, int, int]]:
    cpu = int(math.ceil(timeout_s)) + 1
    mem = int(memory_mb) * 1024 * 1024
    fsize = int(max_file_mb) * 1024 * 1024
    return [(resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, mem, mem),
            (resource.RLIMIT_NPROC, max_procs, max_procs), (resource.RLIMIT_FSIZE, fsize, fsize),
            (resource.RLIMIT_NOFILE, 64, 64), (resource.RLIMIT_CORE, 0, 0)]


def _make_preexec(limits, isolate_net: bool):
    setrlimit = resource.setrlimit

    def preexec():  # runs in the child between fork and exec: C calls only, nothing imported here
        if isolate_net and _UNSHARE is not None:
            _UNSHARE(CLONE_NEWNET)  # fails quietly without CAP_SYS_ADMIN; the audit hook still refuses sockets
        for which, soft, hard in limits:
            try:
                setrlimit(which, (soft, hard))
            except (ValueError, OSError):  # hard limit already lower here, or a limit this OS lacks
                try:
                    setrlimit(which, (min(soft, resource.getrlimit(which)[1]), resource.getrlimit(which)[1]))
                except (ValueError, OSError):
                    pass

    return preexec


_NET: str | None = None


def network_isolation() -> str:
    """'netns' when the child gets a private network namespace here, else 'audit-hook' (sockets refused)."""
    global _NET
    if _NET is None:
        _NET = "audit-hook"
        if _UNSHARE is not None and sys.platform.startswith("linux"):
            probe = subprocess.run([sys.executable, "-I", "-S", "-c", "print(open('/proc/net/dev').read())"],
                                   preexec_fn=_make_preexec([], True), capture_output=True, text=True, timeout=30)
            ifaces = [ln.split(":")[0].strip() for ln in probe.stdout.splitlines()[2:] if ":" in ln]
            if probe.returncode == 0 and ifaces == ["lo"]:
                _NET = "netns"
    return _NET


def _env(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


def run_tests(code: str, tests: str, timeout_s: float = 5.0, memory_mb: int = 512, max_procs: int = 16,
              max_file_mb: int = 8, max_output: int = MAX_OUTPUT) -> SandboxResult:
    """Run `code` then `tests` (asserts) in the sandbox. passed only when the harness's nonce comes back."""
    t0 = time.monotonic()
    nonce = secrets.token_hex(16).encode()
    code_b, tests_b = code.encode("utf-8", "replace"), tests.encode("utf-8", "replace")
    payload = f"{len(nonce)} {len(code_b)}\n".encode() + nonce + code_b + tests_b
    workdir = tempfile.mkdtemp(prefix="mechdiag-sbx-")
    res_r, res_w = os.pipe()
    proc = None
    try:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", HARNESS, str(res_w)], cwd=workdir, env=_env(workdir),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                pass_fds=(res_w,), start_new_session=True,
                preexec_fn=_make_preexec(_limits(timeout_s, memory_mb, max_procs, max_file_mb),
                                         network_isolation() == "netns"))
        except (OSError, subprocess.SubprocessError) as e:
            return SandboxResult(False, "error", time.monotonic() - t0, f"could not start the sandbox: {e}")
        finally:
            os.close(res_w)
        # write from a thread: a child that never reads its stdin must not block us past the deadline
        writer = threading.Thread(target=_feed, args=(proc.stdin, payload), daemon=True)
        writer.start()
        out, result, over, timed_out = _collect(proc, res_r, t0 + timeout_s, max_output)
        _kill_group(proc)
        rc = proc.wait()
    finally:
        os.close(res_r)
        if proc is not None:
            _kill_group(proc)
        shutil.rmtree(workdir, ignore_errors=True)
    duration = time.monotonic() - t0
    text = out.decode("utf-8", "replace")
    detail = text[-DETAIL_CHARS:]
    ok = result.strip() == nonce and rc == 0
    if ok and not timed_out and not over:
        return SandboxResult(True, "passed", duration, detail)
    if timed_out:
        status = "timeout"
    elif over:
        status = "output_limit"
    elif "MemoryError" in text[-600:]:
        status = "memory"
    elif rc == -signal.SIGXCPU:
        status = "timeout"
    elif rc < 0:
        status = "killed"
    elif rc == 0:
        status = "no_nonce"  # exited 0 without finishing the tests: sys.exit / os._exit tricks
    else:
        status = "failed"
    return SandboxResult(False, status, duration, detail or f"exit status {rc}")


def _feed(stream, payload: bytes) -> None:
    try:
        stream.write(payload)
        stream.close()
    except (BrokenPipeError, OSError, ValueError):
        pass


def _collect(proc, res_r: int, deadline: float, max_output: int):
    """Read output (capped) and the result pipe until both close or the deadline passes."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(res_r, selectors.EVENT_READ, "res")
    out, res, total, over, timed_out = bytearray(), bytearray(), 0, False, False
    open_streams = 2
    while open_streams:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for key, _ in sel.select(timeout=min(left, 0.5)):
            fd = key.fd
            chunk = os.read(fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                open_streams -= 1
                continue
            if key.data == "res":
                res += chunk[: 4096 - len(res)]
            else:
                total += len(chunk)
                out += chunk
                if len(out) > 2 * DETAIL_CHARS * 4:
                    del out[: len(out) - DETAIL_CHARS * 4]
                if total > max_output:
                    over = True
        if over:
            break
        if proc.poll() is not None and open_streams and not sel.select(timeout=0.05):
            # the child is gone; a grandchild may hold the pipes open: stop waiting for it
            break
    sel.close()
    return bytes(out), bytes(res), over, timed_out


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_many(jobs: list[tuple[str, str]], workers: int = 2, **kwargs) -> list[SandboxResult]:
    """Run many (code, tests) pairs, `workers` at a time; results in input order."""
    if not jobs:
        return []
    if workers <= 1 or len(jobs) == 1:
        return [run_tests(c, t, **kwargs) for c, t in jobs]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda job: run_tests(job[0], job[1], **kwargs), jobs))
