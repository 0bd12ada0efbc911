"""The exception for problems a user can fix, and the one-line form of a message (the exit policy: common.exits)."""


class CourseError(Exception):
    """An error a user can fix; its message is one line that names the fix (common.exits.run prints only that)."""


def one_line(text, limit: int = 300) -> str:
    """An exception or message folded onto one line and cut to `limit` characters, for error messages."""
    text = " ".join(str(text).split()) or type(text).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."
