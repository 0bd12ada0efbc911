"""The one exception type the course raises for problems a user can fix, and the one-line form of a message.

How a failure becomes one `error:` line and an exit code is the exit policy: common.exits.run.
"""
from __future__ import annotations


class CourseError(Exception):
    """An error a user can fix; its message is one line that names the fix.

    Scripts catch it at the top level (common.exits.run) and print only the message, no traceback.
    """


def one_line(text, limit: int = 300) -> str:
    """An exception or message folded onto one line and cut to `limit` characters, for error messages."""
    text = " ".join(str(text).split()) or type(text).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."
