"""The one exception type for bad user input: the CLI turns it into one stderr line and exit code 2."""

import re


class UserError(Exception):
    """Bad input (missing or corrupt file, invalid config, mismatched shapes...). The message is shown as is."""


def first_line(e: BaseException, limit: int = 300) -> str:
    """An exception as one readable line. torch's "Error(s) in loading state_dict for X:" headline says nothing on
    its own, so the first mismatch below it is kept too (shapes in short form): the line that tells the user which
    base the adapter expects."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    head = lines[0]
    if head.startswith("Error(s) in loading state_dict") and len(lines) > 1:
        detail = re.sub(r"torch\.Size\((\[[^\]]*\])\)", r"\1", lines[1])
        detail = detail.replace("copying a param with shape", "the file has").replace(
            "the shape in current model is", "the model has")
        extra = f" (and {len(lines) - 2} more)" if len(lines) > 2 else ""
        head = f"weights do not fit the model: {detail.rstrip('.')}{extra}"
    return head if len(head) <= limit else head[: limit - 3] + "..."
