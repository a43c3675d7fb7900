"""The sandbox's candidate (untrusted side; see mechdiag/sandbox.py): `main()`, arguments REQ RESP GUARD UID FLAG,
drops to UID, reads the solution on stdin, executes it once, then serves the judge's requests on the REQ/RESP
pipes: names (the values of the solution's globals the tests use), call, getattr, setattr, iter, next, each on an
object the candidate itself holds (by reference number). It never sees the tests. Only plain data leaves it
(codec.py); every other object stays here and is named by a number.

GUARD is the mode (bwrap, landlock, guard-only) or none: an audit hook (the in-process guard) watches for acts
outside what a solution needs (reading or writing outside its folder, process creation, signals, sockets,
native code, introspection). Under guard-only it refuses them (PermissionError): nothing else would hold them.
Under bwrap and landlock the OS layer contains every one of them, so the guard only records the attempt (the
run's `blocked`, written at once on the FLAG pipe to the host) and lets the kernel answer: a correct program is
failed only where its own mode could not contain what it did.
Arguments `probe - - UID`: drop and print ok (the host's probe of an isolation mode).

Imported inside the sandbox from its own folder (mechdiag.sandbox.launch: the folder is on the path only while
it and codec.py load; their bytecode is cached beside them); stdlib only.
"""

import builtins
import collections  # imported before the hook
import os
import sys
import types  # noqa: F401 - imported before the hook (types reads a traceback frame on import)

from codec import Malformed, dumps, enc, loads, read_frame


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


def _kind(e, exceptions):
    """The builtin exception kind of e: the first class of its MRO that is a builtin exception (a class the
    solution defines never names a kind; the judge maps the name through its own closed table)."""
    for k in type(e).__mro__:
        if exceptions.get(k.__name__) is k:
            return k.__name__
    return "Exception"


def _main():
    _drop(sys.argv[4])
    _read, _write, _exit, _id, _type = os.read, os.write, os._exit, id, type
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
    exceptions = {k: v for k, v in _builtins.items() if isinstance(v, type) and issubclass(v, BaseException)}
    # exact stdlib dicts travel as the plain dict they hold (read with dict's own C iteration): compared with a
    # dict they are equal exactly when that dict is, so the verdict is the same and no method of theirs runs
    as_dict = (collections.Counter, collections.OrderedDict, collections.defaultdict)
    if sys.argv[3] != "none":
        hook = _make_hook(root, state, sys.argv[3] == "guard-only", int(sys.argv[5]))
        sys.addaudithook(hook)
        import posix  # noqa: PLC0415 - the same functions as os's, under their own module

        def watch(name):  # special files raise no audit event: the guard sees them here
            call, event = getattr(os, name), "os." + name

            def watched(*a, **k):
                hook(event, a)
                return call(*a, **k)
            setattr(os, name, watched)
            setattr(posix, name, watched)

        watch("mkfifo")
        watch("mknod")
    refs, numbers = {}, {}  # number -> object, id(object) -> number: one object, one number (`is` holds)

    def ref(v, out):
        if _type(v) in as_dict:
            enc({k: x for k, x in _dict_items(v)}, ref, out)
            return
        n = numbers.get(_id(v))
        if n is None:
            n = numbers[_id(v)] = len(refs) + 1
            refs[n] = v  # kept alive: its id stays its own
        out += b"r" + n.to_bytes(4, "big")

    def name_of(name):
        if name not in _builtins:
            raise Malformed("unknown builtin")
        return _builtins[name]

    g = {"__name__": "__main__", "__builtins__": builtins}
    load_error = None
    try:
        exec(compile(code, "solution.py", "exec"), g)
    except BaseException as e:
        load_error = e
    while True:
        frame = read_frame(req, 1 << 30)
        if frame is None:
            _exit(0)
        try:
            msg = loads(frame, refs.__getitem__, name_of)
            if load_error is not None:
                raise load_error
            op = msg[0]
            if op == "names":
                value = {name: g[name] for name in msg[1] if name in g}
            elif op == "call":
                value = refs[msg[1]](*msg[2], **msg[3])
            elif op == "getattr":
                value = getattr(refs[msg[1]], msg[2])
            elif op == "setattr":
                setattr(refs[msg[1]], msg[2], msg[3])
                value = None
            elif op == "iter":
                value = iter(refs[msg[1]])
            elif op == "next":
                value = next(refs[msg[1]])
            else:
                raise ValueError("unknown request")
            reply = ("ok", value)
        except BaseException as e:
            try:
                reply = ("err", _kind(e, exceptions), str(e)[:500])
            except BaseException:
                reply = ("err", "Exception", "unprintable exception")
        try:
            out = dumps(reply + (state["blocked"],), ref)
        except BaseException as e:
            out = dumps(("err", _kind(e, exceptions), "result could not be sent", state["blocked"]), ref)
        for stream in (sys.stdout, sys.stderr):  # the solution's prints, before the judge may end the run
            try:
                stream.flush()
            except BaseException:
                pass
        view = memoryview(out)
        while view:
            view = view[_write(resp, view):]


def _make_hook(root, state, refuse, flag_fd):
    _getcwd, _str, _bytes, _int, _write = os.getcwd, str, bytes, int, os.write
    allow_read = tuple({os.path.realpath(p).rstrip("/") + "/" for p in (
        sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, "/usr/lib", "/usr/lib64", "/lib", "/lib64",
        "/usr/share", "/usr/local/lib")}) + (root + "/",)
    allow_files = ("/dev/null", "/dev/urandom", "/dev/zero", "/etc/localtime", root)
    O_WRITE = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    BLOCK = frozenset("""os.fork os.forkpty os.posix_spawn os.spawn os.exec os.system os.kill os.killpg
        signal.pthread_kill subprocess.Popen pty.spawn socket.__new__ socket.connect socket.bind socket.getaddrinfo
        socket.gethostbyname socket.gethostbyaddr socket.sendto ctypes.dlopen ctypes.dlsym ctypes.cdata
        ctypes.call_function sys.settrace sys.setprofile sys._current_frames gc.get_objects gc.get_referrers
        gc.get_referents resource.setrlimit resource.prlimit os.chroot os.setuid os.setgid os.symlink os.link
        os.chown os.posix_fadvise os.mknod os.mkfifo os.setxattr os.removexattr webbrowser.open
        urllib.Request""".split())
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

    _lstat, _readlink = os.lstat, os.readlink  # the C functions themselves: a solution cannot patch these
    _S_ISLNK = __import__("stat").S_ISLNK
    me = "/proc/" + _str(os.getpid())
    links = {}  # path outside the work folder -> whether it is a symlink

    def norm(p):
        """The real path p names (symlinks and /proc magic links followed, as the kernel would), else None."""
        if type(p) is _bytes:
            p = p.decode("utf-8", "surrogateescape")
        if type(p) is not _str:
            return None
        parts = []
        if not p.startswith("/"):  # the cwd is a real path already (the kernel's): only the rest is resolved
            parts = [x for x in _getcwd().split("/") if x]
        todo, hops = p.split("/")[::-1], 0
        while todo:
            part = todo.pop()
            if part in ("", "."):
                continue
            if part == "..":
                if parts:
                    parts.pop()
                continue
            here = "/" + "/".join(parts + [part])
            link = links.get(here)
            if link is None:
                try:
                    link = _S_ISLNK(_lstat(here).st_mode)
                except (OSError, ValueError):
                    link = False
                if not inside(here):  # the folders outside cannot change under the program: looked at once
                    links[here] = link
            if link:
                hops += 1
                try:
                    target = _readlink(here)
                except (OSError, ValueError):
                    return None  # a magic link that names no path (a pipe, another process's root): refused
                if hops > 40 or ":" in target.split("/")[0]:  # pipe:[N], socket:[N], anon_inode:...
                    return None
                if target.startswith("/"):
                    parts = []  # else relative to the link's folder (/proc/self -> PID)
                todo.extend(target.split("/")[::-1])
                continue
            parts.append(part)
        return "/" + "/".join(parts)

    _stat, _S_ISDIR = os.stat, __import__("stat").S_ISDIR

    def isdir(p):
        try:
            return _S_ISDIR(_stat(p).st_mode)
        except (OSError, ValueError, TypeError):
            return False

    def inside(p):
        return p is not None and (p == root or p.startswith(root + "/"))

    def own(p):  # the program's own /proc files: harmless in every mode
        return p is not None and (p == me or p.startswith(me + "/"))

    def deny(event):
        if not state["blocked"]:  # told to the host at once: a run that never replies (a loop, a kill) still shows
            state["blocked"] = True
            try:
                _write(flag_fd, b"b")
            except OSError:
                pass
        if refuse:  # guard-only: nothing else holds the act
            raise PermissionError("sandbox: " + event + " is not allowed")

    def hook(event, args):
        if event == "sys._getframe":
            if refuse:  # the stdlib asks (namedtuple, logging, warnings) and copes with ValueError
                raise ValueError("sandbox: frame introspection is not allowed")
            return
        try:
            check(event, args)
        except PermissionError:
            raise  # guard-only's refusal
        except Exception:  # arguments the checks cannot read: refused under guard-only, else left to the call
            if refuse:
                deny(event + " with unreadable arguments")

    def check(event, args):
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
            elif p is None or not (p in allow_files or p.startswith(allow_read) or own(p)):
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
                if p is None or not (inside(p) or own(p) or (p + "/").startswith(allow_read)):
                    deny("listing " + _str(args[0]))
        elif event == "import":
            # every part: an extension module loads under a dotted name (x._ctypes runs PyInit__ctypes)
            if any(part in BLOCK_IMPORT for part in _str(args[0]).split(".")):
                deny("import " + args[0])
        elif event == "object.__getattr__" and args[1] in FRAME_ATTRS:
            deny("frame access")
    return hook

def main():
    if sys.argv[1] == "probe":
        _drop(sys.argv[4])
        print("ok")
    else:
        _main()
