"""When training stops before --epochs: --target-accuracy reached, or --patience epochs without a better validation.

Read off History's rows, which every rank holds alike (all-reduced): every rank decides the same, none is left waiting.
"""
from common.log import log0, plural


def best_epoch(rows: list[dict]) -> int | None:
    """The epoch with the best validation accuracy (the earliest of equals); None without validation."""
    if not rows or "val_accuracy" not in rows[0]:
        return None
    return max(rows, key=lambda r: (r["val_accuracy"], -r["epoch"]))["epoch"]


def time_to_target(rows: list[dict], target: float | None) -> float | None:
    """Seconds of training up to the first epoch whose test accuracy reached `target`; None if none has."""
    for i, row in enumerate(rows, 1):
        if target is not None and row["test_accuracy"] >= target:
            return sum(r["epoch_seconds"] for r in rows[:i])
    return None


def should_stop(rows: list[dict], target: float | None, patience: int | None) -> bool:
    """After --target-accuracy is reached, or --patience epochs without a better validation accuracy."""
    if time_to_target(rows, target) is not None:
        return True
    best = best_epoch(rows)
    waited = rows[-1]["epoch"] - best if best else 0
    if patience and waited >= patience:
        log0(f"early stopping: no better val_accuracy for {plural(waited, 'epoch')} (--patience {patience})")
        return True
    return False
