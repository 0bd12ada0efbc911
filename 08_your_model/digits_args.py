"""Lesson 08's digits_lm.py: its command line (parse_args), checked before anything slow starts.

--pretrained or --model-config (one), --export a folder that can be made, --compile a backend torch.compile has;
the learning-rate schedule's flags: schedule.py; --data text's: finetune.py (main checks them with the config).
"""
import torch

from common.cli import Parser, count, positive_float, positive_int
from common.download import default_data_dir
from common.errors import CourseError
from common.files import creatable_folder
from schedule import check_schedule_args

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
DEFAULT_CONFIG = "08_your_model/configs/digits_lm.json"


def parse_args(argv):
    p = Parser(description="Lesson 08: a Hugging Face decoder that draws digits, sharded with FSDP2")
    p.add_argument("--model-config", help=f"the model's Hugging Face config.json (default: {DEFAULT_CONFIG})")
    p.add_argument("--pretrained", metavar="DIR",
                   help="start from a save_pretrained folder (config.json + safetensors), read shard by shard")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16",
                   help="FSDP2's compute dtype; gradients are reduced and weights kept in float32 (default: bfloat16)")
    p.add_argument("--data", choices=["mnist", "synthetic", "text"], default="mnist",
                   help="text: fine-tune the --pretrained model on --text files (default: mnist)")
    p.add_argument("--text", nargs="+", metavar="FILE", help="--data text: .txt files, or .jsonl (\"text\" a line)")
    p.add_argument("--seq-len", type=positive_int, default=128, help="--data text: tokens per block (default: 128)")
    p.add_argument("--val-fraction", type=positive_float, default=0.1,
                   help="--data text: the share of blocks held out for validation (default: 0.1)")
    p.add_argument("--prompt", help="--data text: after training, print the greedy continuation of this text")
    p.add_argument("--data-dir", default=default_data_dir(),
                   help="folder holding MNIST/raw (default: $WORKSHOP_DATA_DIR or ./data)")
    p.add_argument("--train-samples", type=positive_int, help="the first N training images (default: all)")
    p.add_argument("--test-samples", type=positive_int, help="the first N test images (default: all)")
    p.add_argument("--epochs", type=positive_int, default=3, help="(default: 3)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="images per process and step (default: 32)")
    p.add_argument("--test-batch-size", type=positive_int, default=250, help="(default: 250)")
    p.add_argument("--lr", type=positive_float, default=3e-3, help="AdamW's learning rate (default: 3e-3)")
    p.add_argument("--warmup-steps", type=count, default=0, help="linear warm-up over N steps (default: 0)")
    p.add_argument("--min-lr", type=positive_float, help="cosine decay to it after the warm-up (default: none)")
    p.add_argument("--clip-grad", type=positive_float, metavar="MAX", help="clip the gradients' norm (default: off)")
    p.add_argument("--seed", type=count, default=1, help="initial weights, shuffling, drawing (default: 1)")
    p.add_argument("--max-steps", type=positive_int, help="stop each epoch after N steps (default: no cap)")
    p.add_argument("--dry-run", action="store_true", help="smoke test: 1 epoch of 2 steps")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="(default: auto)")
    p.add_argument("--ac", action="store_true",
                   help="activation checkpointing: each decoder layer in checkpoint_wrapper (will_it_fit's fsdp2-ac)")
    p.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND",
                   help="torch.compile each decoder layer (default: off; BACKEND: inductor, or aot_eager)")
    p.add_argument("--output-dir", default="runs/08_digits_lm", help="(default: runs/08_digits_lm)")
    p.add_argument("--resume", help="'auto' or a checkpoint folder, written on any number of ranks (one a stop "
                                    "saved within an epoch: on this number)")
    p.add_argument("--keep-checkpoints", type=positive_int, default=2, help="(default: 2)")
    p.add_argument("--async-checkpoint", action="store_true",
                   help="dcp.async_save: training goes on while the checkpoint is written (default: dcp.save)")
    p.add_argument("--export", metavar="DIR", help="after training, write a from_pretrained folder into DIR")
    p.add_argument("--export-dtype", choices=list(DTYPES), default="bfloat16",
                   help="the exported weights: bfloat16 halves the files and is what GPUs load; float32 keeps the "
                        "master weights exactly (default: bfloat16)")
    p.add_argument("--draw", action="store_true", help="after training, draw one digit per class: digits.png")
    p.add_argument("--temperature", type=positive_float, default=1.0,
                   help="for --draw: 1 samples the model as it is, lower drifts to black (default: 1)")
    p.set_defaults(target_accuracy=None)  # History's early-stopping target: none for a language model
    args = p.parse_args(argv)
    if args.dry_run:
        args.epochs, args.max_steps = 1, 2
    check_schedule_args(args)
    if args.pretrained and args.model_config:
        raise CourseError("--pretrained and --model-config: pass one (a pretrained folder brings its config.json)")
    if args.export and (problem := creatable_folder(args.export)):
        raise CourseError(f"--export {args.export}: {problem}: pick a folder you can write to")
    if args.compile:
        from torch._dynamo import list_backends
        if args.compile not in list_backends(exclude_tags=()):
            raise CourseError(f"--compile {args.compile}: not a torch.compile backend (try inductor or aot_eager)")
    return args
