"""The wire format shared by the sandbox's two programs (candidate.py, judge.py; see mechdiag/sandbox.py): a closed
codec of plain data in length-prefixed frames. It is its own (no marshal, no pickle): the decoder builds only the
types below, so nothing a program sends can become code, a class, or a name looked up on the receiving side.

A value is one tag byte and its body (lengths and counts 4 bytes, big-endian):
  N None, T True, F False, i int (length, two's complement bytes), f float (8 bytes), c complex (16 bytes),
  s str (length, UTF-8 with surrogates kept), b bytes (length, raw),
  l list, t tuple, e set, z frozenset (count, values), d dict (count, key value ...),
  r a reference (id): an object that stays on the side that sent it (the candidate's functions, objects,
    generators...; the judge's proxies of them sent back),
  B a builtin by name (judge -> candidate only: a test may pass `int`; the candidate looks it up itself),
  n / m / k a NaN: mine (id, the value), yours (id), or math.nan / cmath.nan / cmath.nanj by name.
A NaN keeps its identity across the boundary (Python's == on containers, `in` and count check identity first:
[x] == [x] for x = nan): each side numbers the NaNs it sends; one sent back is the receiver's own object.

Run only inside the sandbox's processes (imported from its own folder, never as mechdiag.*): stdlib only.
"""

import os
import sys
from struct import Struct

_U32, _F64, _C128 = Struct(">I"), Struct(">d"), Struct(">dd")
_SEQ = {list: b"l", tuple: b"t", set: b"e", frozenset: b"z"}
_MINE, _MINE_IDS, _THEIRS, _THEIRS_IDS = [], {}, {}, {}
_KNOWN = ("math.nan", "cmath.nan", "cmath.nanj")


class Malformed(ValueError):
    """A frame that is not a value of this codec."""


def _nan(v, out):
    k = _THEIRS_IDS.get(id(v))
    if k is not None:
        out += b"m" + _U32.pack(k)
        return
    for name in _KNOWN:
        mod, _, attr = name.partition(".")
        if getattr(sys.modules.get(mod), attr, None) is v:
            _text(b"k", name, out)
            return
    k = _MINE_IDS.get(id(v))
    if k is None:
        k = _MINE_IDS[id(v)] = len(_MINE)
        _MINE.append(v)
    out += b"n" + _U32.pack(k)
    _plain_number(v, out)


def _plain_number(v, out):
    if type(v) is float:
        out += b"f" + _F64.pack(v)
    else:
        out += b"c" + _C128.pack(v.real, v.imag)


def _text(tag, v, out):
    data = v.encode("utf-8", "surrogatepass")
    out += tag + _U32.pack(len(data)) + data


def enc(v, ref, out):
    """Append value v to bytearray out; anything not plain is handed to ref(v, out), which appends its own
    encoding (a reference, a name) or raises."""
    t = type(v)
    if v is None:
        out += b"N"
    elif t is bool:
        out += b"T" if v else b"F"
    elif t is int:
        n = v.bit_length() // 8 + 1
        out += b"i" + _U32.pack(n) + v.to_bytes(n, "big", signed=True)
    elif t is float or t is complex:
        if v != v:
            _nan(v, out)
        else:
            _plain_number(v, out)
    elif t is str:
        _text(b"s", v, out)
    elif t is bytes:
        out += b"b" + _U32.pack(len(v)) + v
    elif t in _SEQ:
        out += _SEQ[t] + _U32.pack(len(v))
        for x in v:
            enc(x, ref, out)
    elif t is dict:
        out += b"d" + _U32.pack(len(v))
        for k, x in v.items():
            enc(k, ref, out)
            enc(x, ref, out)
    else:
        ref(v, out)


def dumps(v, ref):
    """One frame holding v."""
    out = bytearray(4)
    enc(v, ref, out)
    out[:4] = _U32.pack(len(out) - 4)
    return bytes(out)


def loads(data, ref_of, name_of=None):
    """The value a frame's body holds. ref_of(id) gives the object a reference names; name_of(name) a builtin
    named by the sender (None: names are refused). Raises Malformed for anything else."""
    end = len(data)
    unpack_u32, unpack_f64, unpack_c128 = _U32.unpack_from, _F64.unpack_from, _C128.unpack_from

    def size(pos):
        if pos + 4 > end:
            raise Malformed("truncated")
        n = unpack_u32(data, pos)[0]
        if n > end - pos - 4:  # every element takes at least one byte: a count cannot exceed what is left
            raise Malformed("length past the end")
        return n, pos + 4

    def value(pos):
        if pos >= end:
            raise Malformed("truncated")
        tag = data[pos]
        pos += 1
        if tag == 78:  # N
            return None, pos
        if tag == 84:  # T
            return True, pos
        if tag == 70:  # F
            return False, pos
        if tag == 105:  # i
            n, pos = size(pos)
            return int.from_bytes(data[pos:pos + n], "big", signed=True), pos + n
        if tag == 102:  # f
            if pos + 8 > end:
                raise Malformed("truncated")
            return unpack_f64(data, pos)[0], pos + 8
        if tag == 99:  # c
            if pos + 16 > end:
                raise Malformed("truncated")
            re_, im = unpack_c128(data, pos)
            return complex(re_, im), pos + 16
        if tag == 115 or tag == 66:  # s, B
            n, pos = size(pos)
            try:
                text = bytes(data[pos:pos + n]).decode("utf-8", "surrogatepass")
            except UnicodeDecodeError:
                raise Malformed("bad text") from None
            if tag == 66:
                if name_of is None:
                    raise Malformed("a name where only values may come")
                return name_of(text), pos + n
            return text, pos + n
        if tag == 98:  # b
            n, pos = size(pos)
            return bytes(data[pos:pos + n]), pos + n
        if tag in (108, 116, 101, 122):  # l t e z
            n, pos = size(pos)
            items = []
            for _ in range(n):
                x, pos = value(pos)
                items.append(x)
            if tag == 108:
                return items, pos
            if tag == 116:
                return tuple(items), pos
            return (set(items) if tag == 101 else frozenset(items)), pos
        if tag == 100:  # d
            n, pos = size(pos)
            out = {}
            for _ in range(n):
                k, pos = value(pos)
                out[k], pos = value(pos)
            return out, pos
        if tag == 114:  # r
            if pos + 4 > end:
                raise Malformed("truncated")
            return ref_of(unpack_u32(data, pos)[0]), pos + 4
        if tag == 110:  # n: the sender's NaN, kept by its number
            if pos + 4 > end:
                raise Malformed("truncated")
            k = unpack_u32(data, pos)[0]
            v, pos = value(pos + 4)
            if type(v) not in (float, complex) or v == v:
                raise Malformed("not a NaN")
            if k not in _THEIRS:
                _THEIRS[k] = v
                _THEIRS_IDS[id(v)] = k
            return _THEIRS[k], pos
        if tag == 109:  # m: one of ours
            if pos + 4 > end:
                raise Malformed("truncated")
            k = unpack_u32(data, pos)[0]
            if k >= len(_MINE):
                raise Malformed("unknown NaN")
            return _MINE[k], pos + 4
        if tag == 107:  # k: a NaN of math or cmath
            return _name(pos)
        raise Malformed("unknown tag")

    def _name(pos):
        n, pos = size(pos)
        text = bytes(data[pos:pos + n]).decode("ascii", "replace")
        if text not in _KNOWN:
            raise Malformed("unknown NaN name")
        mod, _, attr = text.partition(".")
        __import__(mod)
        return getattr(sys.modules[mod], attr), pos + n

    try:
        v, pos = value(0)
    except (RecursionError, MemoryError, OverflowError):  # (an unhashable set item or key raises TypeError)
        raise Malformed("too deep or too large") from None
    if pos != end:
        raise Malformed("trailing bytes")
    return v


def read_exact(fd, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_frame(fd, limit):
    """The next frame's body; None at end of stream or when it is larger than limit."""
    head = read_exact(fd, 4)
    if head is None or _U32.unpack(head)[0] > limit:
        return None
    return read_exact(fd, _U32.unpack(head)[0])
