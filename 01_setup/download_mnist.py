"""Lesson 01: fetch MNIST once, on a LOGIN node (compute nodes often have no internet).

From the course folder (01_setup/README.md):
    python 01_setup/download_mnist.py --data-dir $WORKSHOP_DATA_DIR   # real MNIST (about 55 MB unpacked)
    python 01_setup/download_mnist.py --synthetic                     # offline: synthetic digits in MNIST format
Running it again is quick: files that are already there are kept, .gz files found there are extracted. Without
internet it stops with one line naming the four .gz files to copy in from a machine that has it, and where.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common` without pip install

from common.cli import Parser
from common.download import dataset_root, default_data_dir, prepare_data, raw_folder
from common.exits import run
from common.files import work_in_course_folder


def main(argv=None):
    work_in_course_folder()  # relative paths (data/, runs/, --config) are the course folder's
    parser = Parser(description="Download MNIST (or write the synthetic set) into --data-dir")
    parser.add_argument("--data-dir", default=default_data_dir(),
                        help="where MNIST/raw goes (default: $WORKSHOP_DATA_DIR or ./data)")
    parser.add_argument("--synthetic", action="store_true", help="write synthetic MNIST files instead (no internet)")
    args = parser.parse_args(argv)
    kind = "synthetic" if args.synthetic else "mnist"
    prepare_data(args.data_dir, kind)
    print(f"{kind} ready in {raw_folder(dataset_root(args.data_dir, kind))}")
    if not args.synthetic:
        print("train with: --data mnist --data-dir", args.data_dir)
    else:
        print("train with: --data synthetic --data-dir", args.data_dir)


if __name__ == "__main__":
    run(main, sys.argv[1:])
