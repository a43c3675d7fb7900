"""The sandbox's judge (trusted code, run confined; see mechdiag/sandbox.py): `main()`, arguments REQ RESP RES MAX
ENTRY UID. It drops to UID (as root), reads a token line and then the tests on stdin, and executes them. Every
name the tests take from the solution is the value the candidate sends: plain data (codec.py), or a `Remote`
handle for anything else, which the tests may call, read attributes of, iterate, or pass back: each of these runs
in the candidate's process. Nothing the candidate names (a module, a qualified name, a class) is looked up here.
Its one message, on the RES pipe only it holds, is `mechdiag-verdict TOKEN pass|fail KIND [blocked]`.

Imported from its own folder as candidate.py is (mechdiag.sandbox.launch); stdlib only.
"""

import builtins
import os
import sys

from codec import Malformed, dumps, loads, read_frame


class CandidateGone(BaseException):
    """The candidate process ended or broke the protocol: no test after this can pass."""


class CandidateError(Exception):
    """An exception the solution raised (of a kind that is not a builtin exception)."""


class NonPlainData(TypeError):
    pass


NONPLAIN = []  # set when a test used a candidate's object as data
BLOCKED = []
# the exception kinds a reply may name: the builtin exceptions, by the judge's own table. StopIteration would end
# the test's own iteration (all(map(f, xs)) stops early and passes): it is a kind only for `next` on a handle.
KINDS = {k: v for k, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, Exception)
         and not issubclass(v, (StopIteration, StopAsyncIteration))}


def _refuse(name):
    def method(self, *a, **k):
        NONPLAIN.append(name)
        raise NonPlainData("the solution returned an object that is not plain data (" + name + ")")
    return method


class Remote:
    """A candidate's object: called, read, set, iterated and passed back in the candidate's process; never used
    here as data (==, bool, hash, str, arithmetic... fail the test as `nonplain`). It has no __len__ (list()
    asks for a length hint and goes on without one; len() of it fails the test) and no __contains__ (`in`
    iterates it, in the candidate, and compares here)."""
    __slots__ = ("_id",)

    def __init__(self, i):
        object.__setattr__(self, "_id", i)

    def __call__(self, *args, **kwargs):
        return request(("call", self._id, list(args), kwargs))

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return request(("getattr", self._id, name))

    def __setattr__(self, name, value):
        request(("setattr", self._id, name, value))

    def __iter__(self):  # a generator, a map object, a custom iterable: iterated in the candidate
        it = request(("iter", self._id))
        if type(it) is not Remote:
            raise CandidateGone("malformed reply from the solution")
        return it

    def __next__(self):
        return request(("next", self._id))

    def __repr__(self):
        return "<solution object>"


for _name in ("__eq__ __ne__ __lt__ __le__ __gt__ __ge__ __bool__ __hash__ "
              "__getitem__ __str__ __format__ __int__ __float__ __index__ __complex__ __bytes__ __add__ __radd__ "
              "__sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __mod__ __neg__ __abs__ __round__").split():
    setattr(Remote, _name, _refuse(_name))

REMOTES = {}  # number -> its one Remote (the same object twice is the same handle: `is` holds)


def remote(n):
    r = REMOTES.get(n)
    if r is None:
        r = REMOTES[n] = Remote(n)
    return r


def _send_ref(x, out):
    if type(x) is Remote:
        out += b"r" + object.__getattribute__(x, "_id").to_bytes(4, "big")
        return
    name = getattr(x, "__name__", None)
    if type(name) is str and getattr(builtins, name, None) is x:
        data = name.encode()
        out += b"B" + len(data).to_bytes(4, "big") + data
        return
    raise TypeError("a test argument of type " + type(x).__name__ + " cannot be sent to the solution")


REQ = RESP = MAX = None


def request(msg):
    try:
        frame = dumps(msg, _send_ref)
    except RecursionError:
        raise TypeError("a test argument too deep to send") from None
    try:
        os.write(REQ, frame)
    except OSError:
        raise CandidateGone("the solution's process ended") from None
    body = read_frame(RESP, MAX)
    if body is None:
        raise CandidateGone("the solution's process ended, or its reply was too large")
    try:
        reply = loads(body, remote)
    except Malformed:
        raise CandidateGone("malformed reply from the solution") from None
    except TypeError as e:  # a handle inside a set or as a dict key: hashing it is using it as data
        raise NonPlainData("data from the solution rejected: " + str(e)) from None
    if type(reply) is not tuple or len(reply) not in (3, 4) or type(reply[-1]) is not bool:
        raise CandidateGone("malformed reply from the solution")
    if reply[-1]:
        BLOCKED.append(1)
    if reply[0] == "ok" and len(reply) == 3:
        return reply[1]
    if reply[0] == "err" and len(reply) == 4 and type(reply[1]) is str and type(reply[2]) is str:
        if msg[0] == "next" and reply[1] == "StopIteration":
            raise StopIteration
        raise KINDS.get(reply[1], CandidateError)("from the solution: " + reply[1] + ": " + reply[2])
    raise CandidateGone("malformed reply from the solution")


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


def _drop(uid):
    if uid != "-":
        u = int(uid)
        os.setgroups([])
        os.setresgid(u, u, u)
        os.setresuid(u, u, u)
    if os.geteuid() == 0 or os.getuid() == 0:
        os._exit(3)


def main():
    global REQ, RESP, MAX
    _drop(sys.argv[6])
    data = b""
    while True:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            break
        data += chunk
    os.close(0)
    token, _, rest = data.partition(b"\n")
    tests = rest.decode("utf-8", "replace")
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
        # else `set = lambda x: 0` would rig `set(f(x)) == set(expected)`. A name the tests define themselves
        # (a task's helper, such as HumanEval's poly) is rebound by the tests when they run: the task's wins.
        wanted = sorted(n for n in used if n in entry or not (hasattr(builtins, n) or n in STANDARD))
        g = {"__name__": "__main__", "__builtins__": Standard(vars(builtins))}
        values = request(("names", wanted))
        if type(values) is not dict or not all(type(k) is str and k in wanted for k in values):
            raise CandidateGone("malformed reply from the solution")
        g.update(values)
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
    os.write(res, b"mechdiag-verdict " + token + b" " + (outcome + (" blocked" if BLOCKED else "")).encode() + b"\n")
    os._exit(0)

