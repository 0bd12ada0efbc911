"""curves.png: a run's loss and accuracy per epoch, drawn from its metrics.json record."""
from pathlib import Path


def plot_curves(record: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")  # no display on compute nodes
    import matplotlib.pyplot as plt

    rows = record["epochs"]
    epochs = [r["epoch"] for r in rows]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax_loss.plot(epochs, [r["train_loss"] for r in rows], "o-", label="train")
    ax_loss.plot(epochs, [r["test_loss"] for r in rows], "o-", label="test")
    ax_loss.set(xlabel="epoch", ylabel="loss", title="loss")
    ax_loss.legend()
    ax_acc.plot(epochs, [100 * r["test_accuracy"] for r in rows], "o-", color="tab:green", label="test")
    if rows and "val_accuracy" in rows[0]:
        ax_acc.plot(epochs, [100 * r["val_accuracy"] for r in rows], "o-", color="tab:purple", label="validation")
        ax_acc.legend()
    ax_acc.set(xlabel="epoch", ylabel="accuracy (%)", title="accuracy")
    n = record["world_size"]
    synthetic = ", SYNTHETIC digits (not MNIST)" if record["args"].get("data") == "synthetic" else ""
    fig.suptitle(f"{record['lesson']}: {n} process{'es' if n != 1 else ''}, {record['device']}{synthetic}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
