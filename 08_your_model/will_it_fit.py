"""Will it fit? The bytes per GPU of training a Hugging Face decoder, by category, and a verdict: before you submit.

    python 08_your_model/will_it_fit.py 08_your_model/configs/llama3_8b.json --gpus 8 --gpu h100 --strategy fsdp2
    python 08_your_model/will_it_fit.py 08_your_model/configs/llama3_70b.json --gpus 32 --strategy fsdp2-ac

No GPU and no download. The config is read by hf_config.py (dense decoders only: a mixture of experts is refused);
the formula, its moments and what checks it: memory_formula.py (a Llama-style layer only: Gemma-2 is refused).
  ddp       DistributedDataParallel(gradient_as_bucket_view=True) and bf16 autocast: everything on every GPU
  fsdp2     fully_shard per decoder layer, then the root (embeddings, final norm, lm_head), MixedPrecisionPolicy(bf16
            params, fp32 reduce): fp32 weights, gradients and AdamW state sharded (rank 0 holds ceil(rows / N) rows)
  fsdp2-ac  fsdp2 with each decoder layer in checkpoint_wrapper: it saves its input only, and recomputes in backward
  fsdp2-tp  a (N / tp, tp) mesh: q, k, v, gate, up colwise and o, down rowwise in each layer (no sequence parallel),
            then fsdp2 over N / tp; embeddings, norms and lm_head whole on each TP rank. --batch-size: per TP group
--dtype float32: no mixed precision; gathered weights and activations in fp32 too. --seq-len: 4096 by default, or
the config's max_position_embeddings if smaller; a longer one is priced, with a warning.
The GPU's size is its memory as torch reports it (torch.cuda.get_device_properties(0).total_memory), less than the
card's name says: --gpu h100 is 79.18 GiB (an H100 80GB HBM3), --gpu h200 139.80 GiB (143,771 MiB in nvidia-smi):
docs/benchmarks.json's total_memory (the llm suites' torch.cuda.mem_get_info total, torch 2.11.0+cu130, 2026-11-28).
For another GPU, --gpu-memory with the GiB that total_memory / 2**30 shows on it.
On top of the tensors (what torch.cuda.max_memory_allocated() should show), measured on 2x H100 (torch 2.11.0+cu130,
2026-11): CONTEXT_BYTES per process for the CUDA context, cuBLAS and NCCL, and the caching allocator's reserved
memory over the allocated tensors, RESERVED_OVER_ALLOCATED. The verdict: "fits" when tensors x
RESERVED_OVER_ALLOCATED + CONTEXT_BYTES (the total printed) is at most the GPU, "tight" when only tensors +
CONTEXT_BYTES is (it trains only if the allocator fragments less than measured), else "does not fit".
The estimate against measured steps: ddp, fsdp2 and fsdp2-ac within 2% of torch's memory trackers on one CPU model
(memory_formula.py). On GPUs, max_memory_allocated of the fullest rank against it: ddp 1.002 (TinyLlama-1.1B's shape)
and 1.004 (Qwen2-1.5B's), fsdp2 1.004 for both, batch 2 x 2048 on 2 H200s (2026-11-28); fsdp2 and fsdp2-ac within 2%
on one H100 (docs/benchmarks.json's llm_fit rows). measure_memory.py --device cuda prints each step's peak.
Exit codes (for a job script: `python will_it_fit.py ... || exit`): 0 fits or tight, 3 does not fit, 2 bad input.
"""
import dataclasses
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `common`, from any working directory
sys.path.insert(1, str(Path(__file__).resolve().parent))  # hf_config, also when imported from elsewhere

import torch

from common.cli import Parser, positive_float, positive_int
from common.errors import CourseError
from common.exits import run
from common.files import work_in_course_folder
from hf_config import read_config
from memory_formula import CATEGORIES, count, estimate, peak

GIB = 2 ** 30
# The allowance on top of the tensors, each part measured on 2x H100 (torch 2.11.0+cu130, 2026-11):
CONTEXT_BYTES = 1.70e9  # CUDA context + cuBLAS + NCCL per process: mem_get_info() less max_memory_reserved() after
#                         FSDP2 steps over NCCL on H100 (docs: platform notes), 1.58 GiB
RESERVED_OVER_ALLOCATED = dict.fromkeys(("ddp", "fsdp2", "fsdp2-ac", "fsdp2-tp"), 1.31)  # peak reserved over peak
#                         allocated: 1.13-1.31 over fsdp2, fsdp2-ac, ddp and a 152k vocabulary; the largest, for all
STRATEGIES = tuple(RESERVED_OVER_ALLOCATED)
GPUS = {"h100": 85_017_493_504, "h200": 150_109_880_320}  # total_memory as torch reports it (see the docstring)
DOES_NOT_FIT = 3  # the exit code of a "does not fit" verdict
SEQ_LEN = 4096  # the default --seq-len, or the config's max_position_embeddings if smaller
EXAMPLE = "e.g. 08_your_model/configs/llama3_8b.json"


@dataclasses.dataclass
class Price:
    """One training step's bytes on the fullest GPU: the tensors (by category, at the peak moment), the allowance."""
    moment: str  # the step's moment with the most bytes
    bytes: dict  # {category: bytes} at that moment
    tensors: float  # their sum: what torch.cuda.max_memory_allocated() should show
    fits_line: float  # tensors x RESERVED_OVER_ALLOCATED + CONTEXT_BYTES: a GPU this large trains
    tight_line: float  # tensors + CONTEXT_BYTES: below it, nothing trains
    verdict: str = ""  # fits / tight / does not fit, against gpu_bytes
    gpu_bytes: float = 0

    @property
    def allowance(self) -> float:
        return self.fits_line - self.tensors


def lines(tensors: float, strategy: str) -> tuple[float, float]:
    """(the "fits" line, the "tight" line) in bytes for `tensors` bytes of tensors under `strategy`."""
    return tensors * RESERVED_OVER_ALLOCATED[strategy] + CONTEXT_BYTES, tensors + CONTEXT_BYTES


def verdict(fits_line: float, tight_line: float, gpu_bytes: float) -> str:
    return "fits" if fits_line <= gpu_bytes else "tight" if tight_line <= gpu_bytes else "does not fit"


def load_config(path, flag: str = "config"):
    """The config.json as its transformers config (hf_config.read_config: one line for anything it cannot use)."""
    return read_config(path, flag)


def price(config, strategy: str, gpus: int, batch: int, seq: int, tp: int | None = None, dtype: str = "bfloat16",
          gpu_memory_gib: float = GPUS["h100"] / GIB, counted: tuple | None = None) -> Price:
    """The estimate of `strategy` on `gpus` GPUs of `gpu_memory_gib` GiB, batch x seq tokens per GPU, with its
    verdict. `counted`: count(config)'s result, when the caller keeps it (a count builds the model on meta)."""
    shapes, buffers = counted or count(config)
    moment, cats = peak(estimate(config, shapes, buffers, strategy, gpus, tp or 2, batch, seq, dtype))
    tensors = sum(cats.values())
    fits_line, tight_line = lines(tensors, strategy)
    gpu_bytes = gpu_memory_gib * GIB
    return Price(moment, cats, tensors, fits_line, tight_line, verdict(fits_line, tight_line, gpu_bytes), gpu_bytes)


def check(config, args) -> None:
    if args.tp is not None and args.strategy != "fsdp2-tp":
        raise CourseError(f"--tp is for --strategy fsdp2-tp, not {args.strategy}: drop --tp, or use fsdp2-tp")
    tp = tp_of(args)
    if args.gpus % tp:
        raise CourseError(f"--tp {tp} does not divide --gpus {args.gpus}: use a --tp that divides it, or more GPUs")
    heads = {"attention heads": config.num_attention_heads, "intermediate features": config.intermediate_size,
             "key/value heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads}
    for what, number in heads.items():
        if number % tp:
            raise CourseError(f"--tp {tp} does not divide the {number} {what}: use a --tp that divides "
                              f"{math.gcd(*heads.values())}")


def tp_of(args) -> int:
    return (args.tp or 2) if args.strategy == "fsdp2-tp" else 1


def sequence(config, args) -> int:
    """--seq-len, or its default capped at the config's max_position_embeddings; a longer one warned of."""
    most = getattr(config, "max_position_embeddings", None) or SEQ_LEN
    if args.seq_len is None:
        return min(SEQ_LEN, most)
    if args.seq_len > most:
        print(f"warning: --seq-len {args.seq_len} is above the config's max_position_embeddings {most}: priced as "
              f"asked, but the model was not built for it", file=sys.stderr)
    return args.seq_len


def advice(config, shapes, buffers, args) -> str:
    """The smallest change that fits: fewer GPUs first, then no activation checkpointing, else a smaller batch."""
    plain = "fsdp2-tp" if args.strategy == "fsdp2-tp" else "fsdp2"
    tp = tp_of(args)
    for gpus in (args.gpus * 2 ** k for k in range(11)):
        for strategy in (plain, "fsdp2-ac"):
            if (strategy, gpus) == (args.strategy, args.gpus) or (strategy == plain and args.strategy == "fsdp2-ac"):
                continue
            size = price(config, strategy, gpus, args.batch_size, args.seq_len, tp, args.dtype, args.gpu_memory,
                         (shapes, buffers)).fits_line
            if size <= args.gpu_memory * GIB:
                change = f"--strategy {strategy}" + (f" --gpus {gpus}" if gpus != args.gpus else "")
                return f"try {change} ({size / GIB:.1f} GiB)"
    return "lower --batch-size or --seq-len: even 1024x the GPUs with fsdp2-ac do not fit (activations are per GPU)"


def human(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.1f} k"


def report(args) -> dict:
    config = load_config(args.config)
    shapes, buffers = count(config)  # a layer that is not Llama-style stops here
    check(config, args)
    args.seq_len = sequence(config, args)
    result = price(config, args.strategy, args.gpus, args.batch_size, args.seq_len, tp_of(args), args.dtype,
                   args.gpu_memory, (shapes, buffers))
    cats = result.bytes
    params = sum(math.prod(s) for s in shapes.values())
    layer = sum(math.prod(s) for n, s in shapes.items() if ".layers.0." in n)
    mesh = f" (mesh {args.gpus // tp_of(args)} x tp {tp_of(args)})" if args.strategy == "fsdp2-tp" else ""
    share = "" if args.strategy == "ddp" else " shards"
    gpu = f"{args.gpu_memory:.2f} GiB" + (f" ({args.gpu})" if args.gpu else "")
    print(f"{args.config}: {human(params)} parameters ({params:,}, {type(config).__name__[:-6]}ForCausalLM): "
          f"{config.num_hidden_layers} decoder layers of {human(layer)}, "
          f"{human(params - config.num_hidden_layers * layer)} outside them")
    print(f"{args.strategy} on {args.gpus} GPU(s){mesh} of {gpu}, batch {args.batch_size} x {args.seq_len} tokens, "
          f"{args.dtype}{' mixed precision' if args.dtype == 'bfloat16' else ''}; the peak: {result.moment}")
    print(f"{'bytes per GPU':<52}{'bytes':>18}{'GiB':>9}")
    rows = [(CATEGORIES[c].format(share if c != "gathered" else ""), cats[c]) for c in CATEGORIES]
    rows += [("tensors (torch.cuda.max_memory_allocated)", result.tensors),
             (f"allocator reserved ({RESERVED_OVER_ALLOCATED[args.strategy]:g}x) + context "
              f"({CONTEXT_BYTES / GIB:.2f} GiB)", result.allowance),
             ("total with the allocator and context", result.fits_line)]
    for label, value in rows:
        print(f"{label:<52}{value:>18,.0f}{value / GIB:>9.2f}")
    if not cats["gradients"]:
        print("(no gradients at that moment: zero_grad() freed them, and backward has reduced none yet)")
    total, of = result.fits_line / GIB, f"of {args.gpu_memory:.2f} GiB"
    print(f"fits: {total:.1f} {of} ({total / args.gpu_memory:.0%}), {args.gpu_memory - total:.1f} GiB to spare "
          f"after the allowance" if result.verdict == "fits" else
          f"tight: {total:.1f} {of} with the measured allocator share, {result.tight_line / GIB:.1f} without it; "
          f"{advice(config, shapes, buffers, args)}" if result.verdict == "tight" else
          f"does not fit: {total:.1f} {of}; {advice(config, shapes, buffers, args)}")
    return {"parameters": params, **dataclasses.asdict(result)}


def main(argv=None):
    work_in_course_folder()  # relative paths (data/, runs/, --config) are the course folder's
    p = Parser(description=__doc__.splitlines()[0],
               epilog=f"exit codes: 0 fits or tight, {DOES_NOT_FIT} does not fit, 2 bad input")
    p.add_argument("config", help=f"a Hugging Face decoder config.json ({EXAMPLE})")
    p.add_argument("--gpus", type=positive_int, default=1, help="GPUs in the job, all nodes together (default: 1)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--gpu", choices=list(GPUS), help="a GPU's memory as torch reports it: h100 79.18 GiB, h200 "
                      "139.80 GiB (default: h100)")
    size.add_argument("--gpu-memory", type=positive_float, metavar="GIB", help="another GPU's memory in GiB as "
                      "torch.cuda.get_device_properties(0).total_memory / 2**30 shows it (79.18 for an H100 80GB)")
    p.add_argument("--strategy", choices=STRATEGIES, default="fsdp2", help="how the model is spread (default: fsdp2)")
    p.add_argument("--tp", type=positive_int, default=None, help="tensor-parallel degree of fsdp2-tp (default: 2)")
    p.add_argument("--batch-size", type=positive_int, default=1,
                   help="sequences per GPU per step (fsdp2-tp: per TP group) (default: 1)")
    p.add_argument("--seq-len", type=positive_int, default=None, help=f"tokens per sequence (default: {SEQ_LEN}, or "
                   f"the config's max_position_embeddings if smaller)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="bfloat16: mixed precision over fp32 master weights; float32: none (default: bfloat16)")
    args = p.parse_args(argv)
    if args.gpu_memory is None:
        args.gpu = args.gpu or "h100"
        args.gpu_memory = GPUS[args.gpu] / GIB
    return report(args)


if __name__ == "__main__":
    verdicts = []
    run(lambda argv: verdicts.append(main(argv)["verdict"]))  # bad input: exit 2
    sys.exit(DOES_NOT_FIT if verdicts == ["does not fit"] else 0)
