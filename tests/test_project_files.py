"""The install files agree with each other: conda users get what pip users get."""
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement.strip(), maxsplit=1)[0].lower()


def _environment_yml() -> dict:
    """A small parser for our environment.yml (PyYAML is not a dependency of the course)."""
    conda, pip, section = [], [], None
    for raw in (ROOT / "environment.yml").read_text().splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if not line.startswith(" "):
            section = line.split(":")[0]
        elif section == "dependencies":
            item = line.strip().removeprefix("- ").strip()
            if item == "pip:":
                continue
            (pip if raw.startswith("      ") else conda).append(item)
    return {"conda": conda, "pip": pip}


def test_environment_yml_names_every_runtime_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = _environment_yml()
    names = {_name(x) for x in env["conda"] + env["pip"]}
    missing = {_name(d) for d in project["dependencies"]} - names
    assert not missing, f"environment.yml lacks {missing}"
    assert "python=3.11" in env["conda"]
    assert "-e ." in env["pip"], "the conda env must install the course package itself"
    assert {"jupyter", "pytest", "torch"} <= names


def test_torch_floor_is_modern():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "torch>=2.9" in project["dependencies"]  # torch.backends.cuda.matmul.fp32_precision; `make test-floor`
