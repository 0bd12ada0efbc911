"""--config FILE (YAML or TOML) as the parser's defaults; config.yaml out, so `--config runs/X/config.yaml` replays."""
import argparse
import difflib
import json
import os
from pathlib import Path

from common.errors import CourseError
from common.files import atomic_write


def _read_config(path: str) -> dict:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise CourseError(f"--config {path}: {exc.strerror}: check the path") from None
    try:
        if path.endswith(".toml"):
            import tomllib

            values = tomllib.loads(text)
        else:
            import yaml
            values = yaml.safe_load(text) or {}
    except Exception as exc:  # the parsers' own error types differ
        raise CourseError(f"--config {path} is not valid {'TOML' if path.endswith('.toml') else 'YAML'}: "
                          f"{' '.join(str(exc).split())[:200]}") from None
    if not isinstance(values, dict):
        raise CourseError(f"--config {path}: expected `flag: value` lines, e.g. `epochs: 3`")
    return values


def apply_config(parser: argparse.ArgumentParser, path: str) -> None:
    """Make the file's values the parser's defaults, each checked by its flag's own type and choices."""
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    defaults = {}
    for key, value in _read_config(path).items():
        dest = str(key).replace("-", "_")
        if dest not in actions:
            close = difflib.get_close_matches(dest, actions, n=1)
            hint = f": did you mean {close[0].replace('_', '-')}?" if close else ": see --help for the flags"
            raise CourseError(f"--config {path}: unknown key {key!r}{hint}")
        action = actions[dest]
        if isinstance(value, bool) and action.nargs == "?":  # `amp: true`: the bare flag; `amp: false`: not given
            value = action.const if value else action.default
        if value is not None and action.type is not None and not isinstance(value, bool):
            try:
                value = action.type(str(value))
            except argparse.ArgumentTypeError as exc:
                raise CourseError(f"--config {path}: {key}: {exc}") from None
        if action.choices is not None and value not in action.choices and value != action.default:  # amp: null
            raise CourseError(f"--config {path}: {key}: {value!r} is not one of {', '.join(map(str, action.choices))}")
        defaults[dest] = value
    parser.set_defaults(**defaults)


def args_to_dict(args) -> dict:
    """argparse Namespace (or None) -> a dict of plain values, safe for JSON and weights_only loads."""
    return {k: (str(v) if isinstance(v, os.PathLike) else v) for k, v in vars(args or argparse.Namespace()).items()}


def save_config(args, path) -> None:
    """The resolved flags as YAML (one `flag: value` line each): `--config PATH` runs the same again."""
    skip = {"config", "resume", "dry_run"}  # how THIS run was started, not what it trains
    lines = [f"{k.replace('_', '-')}: {json.dumps(v)}" for k, v in args_to_dict(args).items() if k not in skip]
    with atomic_write(path, "w") as f:
        f.write("# written by the run itself: replay it with --config this-file (and another --output-dir)\n")
        f.write("\n".join(lines) + "\n")
