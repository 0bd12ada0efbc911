"""The one exception type the course raises for problems a user can fix."""


class CourseError(Exception):
    """An error a user can fix; its message is one line that names the fix.

    Scripts catch it at the top level and print only the message (no traceback).
    """
