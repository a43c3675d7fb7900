"""The sandbox's judge (trusted side; see mechdiag/sandbox.py): `main()`, arguments REQ RESP RES MAX ENTRY, reads
the tests on stdin and executes them; every name they take from the solution is a proxy that reaches the
candidate over the REQ/RESP pipes, and only plain data comes back. Its last word, on the RES pipe only it holds,
is `pass` or `fail KIND` (and `blocked` when the guard refused something).

Imported from its own folder as candidate.py is (mechdiag.sandbox.launch); stdlib only.
"""

import builtins
import marshal
import os
import sys

from codec import dumps, enc, nan_of, read_frame


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
