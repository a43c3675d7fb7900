"""The sandbox's candidate (untrusted side; see mechdiag/sandbox.py): `main()`, arguments REQ RESP GUARD UID,
drops to UID, reads the solution on stdin, executes it once, then serves the judge's requests (names, call,
getattr, setattr) on the REQ/RESP pipes. It never sees the tests. With GUARD == "guard", an audit hook (the
in-process guard) refuses operations outside the work folder, process creation, signals and introspection.
Arguments `probe - - UID`: drop and print ok (the host's probe of an isolation mode).

Imported inside the sandbox from its own folder (mechdiag.sandbox.launch: the folder is on the path only while
it and codec.py load; their bytecode is cached beside them); stdlib only.
"""

import builtins
import collections  # imported before the hook
import marshal
import os
import sys
import types  # imported before the hook (types reads a traceback frame on import)

from codec import dumps, enc, nan_of, read_frame


# the first statement (and the probe's): a root start drops every uid, gid and group, which clears all
# capabilities; it stops when uid 0 remains
def _drop(uid):
    if uid != "-":
        u = int(uid)
        os.setgroups([])
        os.setresgid(u, u, u)
        os.setresuid(u, u, u)
    if os.geteuid() == 0 or os.getuid() == 0:
        os._exit(3)

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
    _builtins, _dict_items = dict(vars(builtins)), dict.items
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

    g = {"__name__": "__main__", "__builtins__": builtins}
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
    # audit hooks are per interpreter: a subinterpreter (or _testcapi's run_in_subinterp) would run without this one;
    BLOCK_IMPORT = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "cffi", "_cffi_backend", "multiprocessing",
                              "_multiprocessing", "pty", "_xxsubinterpreters", "_xxinterpchannels", "_interpreters",
                              "_interpchannels", "_interpqueues", "_testcapi", "_testinternalcapi",
                              "_testmultiphase", "_testsinglephase", "_testclinic", "_testimportmultiple",
                              "_posixshmem"})  # POSIX shared memory: host RAM outside RLIMIT_AS, no audit event
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

def main():
    if sys.argv[1] == "probe":
        _drop(sys.argv[4])
        print("ok")
    else:
        _main()
