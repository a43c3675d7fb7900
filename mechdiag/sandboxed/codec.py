"""The wire format shared by the sandbox's two programs (candidate.py, judge.py; see mechdiag/sandbox.py): plain
data as tagged lists in length-prefixed marshal frames. marshal is built in (no import cost); the judge checks
every type it gets back, so marshal's own types never pass. Lists carry a tag first: L list, T tuple, S set,
F frozenset, D dict (k, v, k, v...), B bytes, C complex (re, im), R an opaque reference (id), N a builtin by name
(a test may pass `int`). `ref` encodes everything else.

Run only inside the sandbox's processes (imported from its own folder, never as mechdiag.*): stdlib only.
"""

import marshal
import os
import sys

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
