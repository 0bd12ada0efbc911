"""Execute every lesson notebook headless on CPU and check what it computed."""
import re

import nbformat
import pytest
from nbclient import NotebookClient

from lessons import ROOT

NOTEBOOKS = ["01_setup/setup.ipynb", "02_singlegpu_training/singlegpu.ipynb", "03_dp_training/dp.ipynb",
             "04_ddp_training/ddp.ipynb", "05_multigpu_fsdp_training/fsdp.ipynb"]


def outputs_text(book) -> str:
    parts = []
    for cell in book.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", "") or "".join(out.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


@pytest.mark.parametrize("path", NOTEBOOKS)
def test_committed_without_outputs(path):
    book = nbformat.read(ROOT / path, as_version=4)
    assert all(not c.get("outputs") and not c.get("execution_count") for c in book.cells if c.cell_type == "code")


@pytest.mark.parametrize("path", NOTEBOOKS)
def test_notebook_runs_and_computes(path, synthetic_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WORKSHOP_DATA_DIR", synthetic_dir)
    monkeypatch.setenv("NOTEBOOK_OUTPUT_DIR", str(tmp_path / "run"))
    book = nbformat.read(ROOT / path, as_version=4)
    NotebookClient(book, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str((ROOT / path).parent)}}).execute()
    text = outputs_text(book)
    assert "Warning" not in text, text[-3000:]
    result = re.search(r"NOTEBOOK RESULT lesson=(\d\d) (.*)", text)
    assert result and result.group(1) == path[:2], text[-3000:]
    values = dict(kv.split("=") for kv in result.group(2).split())
    if "test_accuracy" in values:
        assert float(values["test_accuracy"]) > 0.5
    if path.startswith("01"):
        assert values == {"ranks": "2", "all_reduce": "3.0", "env_status": "0"}
        assert "OK: all_reduce, broadcast, all_gather and barrier verified on 2 rank(s)" in text  # the torchrun cell
    if path.startswith("02"):
        assert "waiting for the DataLoader" in text and (tmp_path / "run" / "metrics.json").is_file()
    if path.startswith("04"):
        assert values["test_samples"] == "501" and values["world_size"] == "2"
    if path.startswith("05"):
        assert (values["saved_ranks"], values["resumed_ranks"]) == ("2", "1")
