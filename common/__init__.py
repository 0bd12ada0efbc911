"""Plumbing shared by the lessons; what each lesson teaches is written out in the lesson scripts themselves."""
import importlib.util as _util
import sys as _sys

# A lesson run by a Python whose torch came from elsewhere (a cluster's `module load`) may lack the course's
# other packages: one line naming the fix, not a ModuleNotFoundError traceback. (pip name, import name)
_missing = [pip for pip, module in (("torch", "torch"), ("tqdm", "tqdm"), ("pyyaml", "yaml"),
                                    ("matplotlib", "matplotlib")) if _util.find_spec(module) is None]
if _missing:
    raise SystemExit(f"error: {', '.join(_missing)} not installed for {_sys.executable}: activate the course's "
                     f"environment (source .venv/bin/activate, or conda activate dist-pytorch-course), or "
                     f"`pip install {' '.join(_missing)}` into this Python")
