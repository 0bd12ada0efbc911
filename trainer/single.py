r"""The trainer's --parallel single: the classic MNIST CNN on ONE device (lesson 02's loop).

The baseline the other strategies change as little as possible. From the course folder (trainer/README.md):
    python trainer/train.py --parallel single --train-samples 2000 --test-samples 1000 \
        --epochs 2 --num-workers 0
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common`

from common.checkpoints import CheckpointDir
from common.cli import base_parser, parse
from common.files import work_in_course_folder
from common.log import log0
from common.model import Net, model_flags
from trainer.amp import autocast_dtype
from trainer.data import load_data, make_loaders
from trainer.loop import Run
from trainer.process import one_device
from trainer.state import TorchSave

LESSON = "trainer-single"  # the checkpoints' signature, and the default runs/trainer-single


def main(argv=None):
    work_in_course_folder()  # relative paths (data/, runs/, --config) are the course folder's
    parser = base_parser(LESSON, "Lesson 02: MNIST on one GPU (or the CPU)")
    parser.add_argument("--profile", action="store_true",
                        help="profile 30 training steps with torch.profiler and print where the time goes")
    args = parse(parser, argv)
    if args.profile:
        args.epochs, args.max_steps = 1, min(args.max_steps or 30, 30)
    checkpoints = CheckpointDir(args, LESSON)
    device = one_device(args)  # cuda if there is a GPU, else cpu
    log0(f"lesson 02: 1 process on {device}")  # the first line of every run, before any resume: line
    resume = checkpoints.resume_from(args.resume)  # before anything slow: a used --output-dir is refused

    loaders = make_loaders(args, device, *load_data(args))
    amp_dtype = autocast_dtype(args.amp, device)  # --amp: bfloat16 where the device has it natively, else float16
    model = Net(**model_flags(args)).to(device)
    if args.compile:
        model.compile(backend=args.compile)  # torch.compile in place: state_dict keys stay the same
    return Run(args, LESSON, device, model, loaders, checkpoints, TorchSave(), resume, amp_dtype=amp_dtype).fit()
