"""Lesson 08, exercise 1: the notebook's Qwen2 folder loaded on 3 ranks: which rows does each rank read?

    python 08_your_model/solutions/three_ranks.py

FSDP2 shards dimension 0 as torch.chunk does: ceil(rows / N) rows per rank, the last rank what is left. The
embedding's 43 rows on 3 ranks: ceil(43 / 3) = 15, so rows 0-14, 15-29 and 30-42 (13 rows); a q_proj of 32 rows:
11, 11, 10. hf_shards.load_pretrained reads exactly these rows of each tensor (my_rows), so the sharded model's
logits are from_pretrained's on any number of ranks, an uneven one included.
"""
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

from common.launcher import launch  # noqa: E402

import notebook_workers as nw  # noqa: E402

RANKS = 3


def predicted(rows: int, ranks: int) -> list[int]:
    chunk = -(-rows // ranks)  # ceil
    return [max(0, min(chunk, rows - r * chunk)) for r in range(ranks)]


def main():
    print(f"predicted rows per rank on {RANKS} ranks: embedding (43) {predicted(43, RANKS)}, "
          f"q_proj (32) {predicted(32, RANKS)}")
    with tempfile.TemporaryDirectory() as folder:
        nw.write_folder(folder)
        launch(nw.shards, nprocs=RANKS, args=(folder,), timeout_s=240)
        diffs = launch(nw.load_and_compare, nprocs=RANKS, args=(folder,), timeout_s=240)
    print(f"largest |sharded - from_pretrained| over {RANKS} ranks: {max(diffs):.1e}")


if __name__ == "__main__":
    main()
