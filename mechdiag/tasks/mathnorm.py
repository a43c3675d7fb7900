"""Answer equivalence for LaTeX answers (MATH-500).

`normalize` rewrites an answer to a canonical string: unwraps \\boxed{} and $...$, drops \\left/\\right, spacing
commands (\\! \\, \\;), \\text{}/\\mbox{} wrappers, unit words in them, degree marks, \\$ and %, thousands
separators; maps \\dfrac/\\tfrac to \\frac and completes brace-less arguments (\\frac12 -> \\frac{1}{2},
\\sqrt2 -> \\sqrt{2}); removes all whitespace; strips a leading "x=" and "(C)" -> "C".
`equivalent(a, b)` is true when the canonical strings match, when both are the same number (3/4, 0.75,
\\frac{3}{4}, mixed 1\\frac{4}{5}), when both are lists/tuples of equivalent items (bracketed: in order;
bare comma lists: as multisets), or when a restricted, sanitised sympy translation evaluates to the same value
(with variables: at three fixed points).
"""

from __future__ import annotations

import re
import warnings
from fractions import Fraction

UNITS = ("degrees", "degree", "cents", "cent", "dollars", "dollar", "inches", "inch", "feet", "foot", "ft",
         "cm", "mm", "km", "meters", "meter", "units", "unit", "square", "sq", "hours", "hour", "minutes",
         "minute", "seconds", "second", "days", "day", "mph", "miles", "mile", "pounds", "pound", "cubic",
         "yards", "yard", "people", "students", "ways", "points")
_UNIT_RE = "|".join(sorted(UNITS, key=len, reverse=True))
_TEXT_CMDS = r"\\(?:text|textbf|textit|mbox|mathrm|mathbf|textnormal|operatorname)"


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) with balanced braces."""
    i = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if i < 0:
        return None
    j = text.find("{", i)
    if j < 0:
        m = re.match(r"\\boxed\s+(\S+)", text[i:])
        return m.group(1) if m else None
    depth = 0
    for k in range(j, len(text)):
        depth += {"{": 1, "}": -1}.get(text[k], 0)
        if depth == 0:
            return text[j + 1:k]
    return None


def _arg(s: str, i: int) -> tuple[str, int]:
    """One TeX argument starting at s[i] (after spaces): {balanced} or a single character."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        return "", i
    if s[i] != "{":
        return s[i], i + 1
    depth = 0
    for k in range(i, len(s)):
        depth += {"{": 1, "}": -1}.get(s[k], 0)
        if depth == 0:
            return s[i + 1:k], k + 1
    return s[i + 1:], len(s)


def _brace_args(s: str, cmd: str, nargs: int) -> str:
    """Give each `cmd` braced arguments: \\frac12 -> \\frac{1}{2}, \\frac 59 -> \\frac{5}{9}."""
    out, i = [], 0
    while (j := s.find(cmd, i)) >= 0:
        out.append(s[i:j] + cmd)
        k = j + len(cmd)
        if k < len(s) and (s[k].isalpha() or s[k] == "["):
            i = k
            continue
        for _ in range(nargs):
            a, k = _arg(s, k)
            out.append("{" + _brace_args(a, cmd, nargs) + "}")
        i = k
    out.append(s[i:])
    return "".join(out)


def normalize(ans: str) -> str:
    s = str(ans).strip()
    boxed = last_boxed(s)
    if boxed is not None:
        s = boxed
    s = s.strip().strip("$").strip()
    s = re.sub(r"^\\\(|\\\)$|^\\\[|\\\]$", "", s).strip()
    s = re.sub(r"\\left(?![a-zA-Z])|\\right(?![a-zA-Z])", "", s)
    s = re.sub(r"\\[!,;:> ]", "", s).replace("~", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\displaystyle", "")
    # units inside \text{}/\mbox{}, with an optional power: "864 \mbox{ inches}^2" -> "864"
    s = re.sub(_TEXT_CMDS + r"\{\s*(?:" + _UNIT_RE + r")(?:\s+(?:" + _UNIT_RE + r"))*\s*\}(?:\^\{?\d\}?)?", "", s)
    s = re.sub(_TEXT_CMDS + r"\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|°", "", s)
    s = re.sub(r"(?<=[\d}])\s+(?:" + _UNIT_RE + r")(?:\^\d)?\s*$", "", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = _brace_args(s, "\\frac", 2)
    s = _brace_args(s, "\\sqrt", 1)
    s = re.sub(r"\s+", "", s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    m = re.fullmatch(r"[a-zA-Z]\s*=\s*([^=]+)", s)
    if m and not re.fullmatch(r"[a-zA-Z]", m.group(1)):
        s = m.group(1)
    s = re.sub(r"^\(([A-Z])\)$", r"\1", s).rstrip(".")
    num = to_number(s)
    if num is not None:
        s = str(num.numerator) if num.denominator == 1 else f"{num.numerator}/{num.denominator}"
    return s


def to_number(s: str) -> Fraction | None:
    """A normalised answer as an exact number: 3, -0.5, .35, 3/4, \\frac{3}{4}, -\\frac{3}{4}, 1\\frac{4}{5}."""
    s = s.strip()
    try:
        if re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)(/\d+)?", s):
            return Fraction(s)
        m = re.fullmatch(r"([-+]?)(\d*)\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
        if m:
            sign = -1 if m.group(1) == "-" else 1
            whole = int(m.group(2)) if m.group(2) else 0
            frac = Fraction(int(m.group(3)), int(m.group(4)))
            return sign * (whole + frac)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _split_top(s: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


_SAFE = re.compile(r"[0-9a-zA-Z+\-*/(). ]*")


def _to_sympy_text(s: str) -> str | None:
    t = s
    for _ in range(5):
        t = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", t)
        t = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", t)
    t = t.replace("\\pi", "pi").replace("\\cdot", "*").replace("\\times", "*").replace("^", "**")
    t = t.replace("{", "(").replace("}", ")")
    if "\\" in t or not _SAFE.fullmatch(t):
        return None
    # powers only of a small literal, at most three of them: "9^9^9^9" or "(a+b)^999" would never finish
    powers = re.findall(r"\*\*(\(?-?\d{1,2}\)?)?(?!\d)", t)
    words = set(re.findall(r"[a-zA-Z]+", t))
    symbolic = bool(words - {"sqrt", "pi"})
    if len(powers) > 3 or any(not p or int(p.strip("()")) > (9 if symbolic else 99) for p in powers) \
            or re.search(r"\*\*[^*]*\*\*\(?\d", t):
        return None
    if not words <= {"sqrt", "pi"} | set("abcdefghjkmnpqrstuvwxyz"):
        return None
    return t


def _close(x, y) -> bool:
    try:
        cx, cy = complex(x), complex(y)
    except (TypeError, ValueError, OverflowError):
        return False
    if cx != cx or cy != cy or abs(cx) == float("inf"):
        return False
    return abs(cx - cy) <= 1e-9 * max(1.0, abs(cy))


def _sympy_equal(a: str, b: str) -> bool:
    """Numeric check through sympy: equal values, or (with variables) equal values at three fixed points.
    No expansion or simplification, so the cost stays bounded by the translation's size limits."""
    ta, tb = _to_sympy_text(a), _to_sympy_text(b)
    if ta is None or tb is None or len(ta) > 80 or len(tb) > 80:
        return False
    try:
        with warnings.catch_warnings():  # sympy deprecation chatter on odd inputs
            warnings.simplefilter("ignore")
            return _sympy_values_equal(ta, tb)
    except Exception:  # anything sympy cannot read is simply not shown equal
        return False


def _sympy_values_equal(ta: str, tb: str) -> bool:
    from sympy import N  # noqa: PLC0415 - sympy loads only for LaTeX answers
    from sympy.parsing import sympy_parser as sp  # noqa: PLC0415 - sympy loads only for LaTeX answers

    tr = sp.standard_transformations + (sp.implicit_multiplication_application,)
    ea, eb = sp.parse_expr(ta, transformations=tr), sp.parse_expr(tb, transformations=tr)
    names = sorted(ea.free_symbols | eb.free_symbols, key=str)
    if not names:
        return _close(N(ea), N(eb))
    points = [{v: 0.31 + 0.17 * i + 0.53 * k for i, v in enumerate(names)} for k in range(3)]
    return all(_close(N(ea.subs(p)), N(eb.subs(p))) for p in points)


def equivalent(a: str, b: str) -> bool:
    na, nb = normalize(a), normalize(b)
    if not na or not nb:
        return False
    if na == nb:
        return True
    x, y = to_number(na), to_number(nb)
    if x is not None and y is not None:
        return x == y
    if na[:1] in "([" and nb[:1] in "([" and na[-1:] in ")]" and nb[-1:] in ")]":
        if na[0] != nb[0] or na[-1] != nb[-1]:
            return False
        pa, pb = _split_top(na[1:-1]), _split_top(nb[1:-1])
        return len(pa) == len(pb) > 1 and all(equivalent(p, q) for p, q in zip(pa, pb, strict=True))
    pa, pb = _split_top(na), _split_top(nb)
    if len(pa) > 1 or len(pb) > 1:
        if len(pa) != len(pb):
            return False
        left = list(pb)
        for p in pa:
            hit = next((q for q in left if equivalent(p, q)), None)
            if hit is None:
                return False
            left.remove(hit)
        return True
    return _sympy_equal(na, nb)
