"""Expand Slurm host lists such as ``gpu[01-03,07],cpu5`` into host names, like ``scontrol show hostnames``."""
from common.errors import CourseError


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise CourseError(f"malformed Slurm host list {text!r}")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise CourseError(f"malformed Slurm host list {text!r}: unclosed '['")
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_range(item: str) -> list[str]:
    """'01-03' -> ['01', '02', '03'], keeping the zero padding; '7' -> ['7']."""
    lo, _, hi = item.partition("-")
    if not hi:
        return [lo]
    if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
        raise CourseError(f"malformed Slurm host range {item!r}")
    return [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]


def _expand_one(host: str) -> list[str]:
    """Expand the first bracket group, then the rest of the name recursively (``a[1-2]b[3-4]``)."""
    if "[" not in host:
        return [host]
    prefix, _, rest = host.partition("[")
    inner, _, suffix = rest.partition("]")
    return [prefix + value + tail
            for item in inner.split(",")
            for value in _expand_range(item)
            for tail in _expand_one(suffix)]


def expand_hostlist(nodelist: str) -> list[str]:
    """All host names of a Slurm node list, in order. The first one hosts rank 0 (MASTER_ADDR)."""
    return [name for part in _split_top_level(nodelist.strip()) for name in _expand_one(part)]
