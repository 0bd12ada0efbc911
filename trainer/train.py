r"""The production trainer: one entry point for every strategy the lessons 02-07 teach, with what a long run needs
(exact mid-epoch resume, stop votes on signals, requeue, AMP, compile, schedules, metrics.json; trainer/README.md).

    python trainer/train.py --parallel single --data synthetic --epochs 2 --num-workers 0
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 trainer/train.py --parallel ddp --data synthetic \
        --train-samples 4000 --test-samples 1000 --epochs 2 --num-workers 0
`--parallel P --help` lists that strategy's flags.
"""
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common` and `trainer`

from common.cli import Parser
from common.exits import run

# --parallel: (module of trainer/, its main's keyword arguments)
STRATEGIES = {"single": ("single", {}), "dp": ("dp", {}), "ddp": ("ddp", {}), "fsdp2": ("fsdp2", {}),
              "tp": ("tp", {"parallel": "tp"}), "2d": ("tp", {"parallel": "2d"}), "pp": ("pp", {})}
HELP = ("single: one device (lesson 02); dp: nn.DataParallel (03); ddp: DistributedDataParallel (04); fsdp2: "
        "fully_shard (05); tp: tensor parallelism over every process (06); 2d: TP x FSDP2 (06); pp: pipeline "
        "stages x FSDP2 (07). The distributed ones under torchrun or srun")


def main(argv=None):
    """Take --parallel off the command line and hand the rest to that strategy's main."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    pick = Parser(add_help=False)
    pick.add_argument("--parallel", choices=list(STRATEGIES))
    chosen, rest = pick.parse_known_args(argv)  # a wrong choice: one line, exit 2
    if chosen.parallel is None:  # --help, or --parallel forgotten (one line, exit 2)
        full = Parser(description=__doc__.split("\n\n")[0], epilog="Then the flags of the strategy: "
                      "train.py --parallel P --help")
        full.add_argument("--parallel", choices=list(STRATEGIES), required=True, help=HELP)
        full.parse_args(argv)
    name, options = STRATEGIES[chosen.parallel]
    return importlib.import_module(f"trainer.{name}").main(rest, **options)


if __name__ == "__main__":
    run(main)
