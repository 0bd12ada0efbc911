r"""Peer: torchtitan 0.2.2's own Trainer (its Llama-3 model, parallelize_llama: FSDP2, AC, compile, float8) on
benchmarks/llm.py's synthetic copy-task tokens; one JSON row (rank 0): tokens/s per GPU and peak memory.

Its C4 loader needs `datasets` (and pyarrow) and the repository's tests/assets, neither in its wheel: a train spec
"llama3_synthetic" is registered instead, llama3's own but for the dataloader (these tokens, the same per step and
rank as the course's runs) and no tokenizer. Modules it imports but this peer never calls get empty stand-ins when
absent (stand_ins()). The timed steps: all but the first WARMUP, each ended by a synchronize.
Wheels (--no-deps): torchtitan-0.2.2, tyro, docstring_parser, typeguard, einops, torchdata (+ torchao for float8).
    torchrun --standalone --nproc_per_node=4 benchmarks/peers/titan_synthetic.py \
        --job.config_file benchmarks/peers/titan_llama3_8b.toml
    python benchmarks/peers/titan_synthetic.py --peer-dry-run --job.config_file benchmarks/peers/titan_llama3_8b.toml
"""
import json
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import llm  # noqa: E402

WARMUP = 2  # untimed steps (the compile's), as llama8b_calls.sh's llama8b_train.py --warmup 2


def stand_ins() -> None:
    """Modules torchtitan imports at import time that this peer never calls: `datasets` (its C4 loader) and
    torch.utils.tensorboard (which imports the tensorboard package; used with [metrics] enable_tensorboard only).
    Each absent one gets an empty stand-in under its name."""
    try:
        import datasets  # noqa: F401
    except ImportError:
        fake = types.ModuleType("datasets")
        fake.Dataset = fake.load_dataset = None
        fake.distributed = types.ModuleType("datasets.distributed")
        fake.distributed.split_dataset_by_node = None
        sys.modules.update({"datasets": fake, "datasets.distributed": fake.distributed})
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        fake = types.ModuleType("torch.utils.tensorboard")
        fake.SummaryWriter = None
        sys.modules["torch.utils.tensorboard"] = fake


class Tokens:
    """torchtitan's batch: ({"input": tokens}, labels), next-token labels; llm.tokens' copy task."""

    def __init__(self, vocab: int, batch: int, seq: int, rank: int):
        self.vocab, self.batch, self.seq, self.rank, self.step = vocab, batch, seq, rank, 0

    def __iter__(self):
        while True:
            ids = llm.tokens(self.vocab, self.batch, self.seq + 1, 1, self.step, self.rank, "cpu")
            self.step += 1
            yield {"input": ids[:, :-1]}, ids[:, 1:]

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def register() -> None:
    import dataclasses

    from torchtitan.models.llama3 import get_train_spec, llama3_args
    from torchtitan.protocols.train_spec import register_train_spec

    def loader(dp_world_size, dp_rank, tokenizer, job_config):
        vocab = llama3_args[job_config.model.flavor].vocab_size
        return Tokens(vocab, job_config.training.local_batch_size, job_config.training.seq_len, dp_rank)

    register_train_spec("llama3_synthetic", dataclasses.replace(
        get_train_spec(), build_dataloader_fn=loader, build_tokenizer_fn=None, build_validator_fn=None))


def dry_run(argv) -> None:
    """No GPU (torchtitan's Trainer sets a CUDA device first): the config parsed as the Trainer parses it, the train
    spec's model built on the meta device, and one batch of its loader: one JSON row."""
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    cfg = ConfigManager().parse_args(argv)
    spec = get_train_spec(cfg.model.name)
    args = spec.model_args[cfg.model.flavor]
    args.update_from_config(cfg)
    with torch.device("meta"):
        model = spec.model_cls(args)
    parameters, flops = args.get_nparams_and_flops(model, cfg.training.seq_len)
    inputs, labels = next(iter(spec.build_dataloader_fn(1, 0, None, cfg)))
    print(json.dumps({"what": "peer_torchtitan dry run", "name": cfg.model.name, "flavor": cfg.model.flavor,
                      "parameters": parameters, "flops_per_token": flops, "dim": args.dim, "n_layers": args.n_layers,
                      "vocab_size": args.vocab_size, "seq": cfg.training.seq_len,
                      "batch": cfg.training.local_batch_size, "input_shape": list(inputs["input"].shape),
                      "labels_shape": list(labels.shape), "ac": cfg.activation_checkpoint.mode,
                      "compile": cfg.compile.enable, "converters": cfg.model.converters}), flush=True)


def main():
    stand_ins()
    register()
    if "--peer-dry-run" in sys.argv:
        return dry_run([a for a in sys.argv[1:] if a != "--peer-dry-run"])
    from torchtitan.train import Trainer
    from torchtitan.train import main as titan_main

    class Timed(Trainer):
        times: list = []

        def train_step(self, data_iterator):
            super().train_step(data_iterator)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.times.append(time.perf_counter())

        def close(self):
            cfg, device = self.job_config, self.device
            if torch.distributed.get_rank() == 0 and len(self.times) > WARMUP:
                timed = len(self.times) - WARMUP
                seconds = self.times[-1] - self.times[WARMUP - 1]
                row = {"what": "peer_torchtitan", "flavor": cfg.model.flavor, "seq": cfg.training.seq_len,
                       "batch": cfg.training.local_batch_size, "ac": cfg.activation_checkpoint.mode,
                       "compile": cfg.compile.enable, "converters": cfg.model.converters,
                       "gpus": torch.distributed.get_world_size(), "timed_steps": timed,
                       "step_s": seconds / timed,
                       "tokens_per_s": cfg.training.local_batch_size * cfg.training.seq_len * timed / seconds,
                       **llm.memory(device)}
                print(json.dumps(row), flush=True)
            super().close()

    titan_main(Timed)


if __name__ == "__main__":
    main()
