"""The data of a run: MNIST (or its synthetic stand-in) split once, and the loaders of this process's share."""
from functools import partial

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from common.data import load_mnist
from common.loaders import DeviceLoader, loader_options
from common.samplers import EvalSampler


def load_data(args):
    """(train, validation or None, test); --val-samples are held out of train. Under torchrun: the same split on
    every rank, rank 0 prepares the files and the others wait."""
    group = dist.is_initialized()
    return load_mnist(args.data_dir, args.data, args.train_samples, args.test_samples, args.val_samples,
                      seed=args.seed, is_main=not group or dist.get_rank() == 0,
                      barrier=dist.barrier if group else None)  # rank 0 downloads, the rest wait


def make_loader(args, dataset, batch_size, sampler, device):
    """Batches of the sampler's indices: a DataLoader, or with --data-on-device slices of tensors on the GPU."""
    if args.data_on_device:
        return DeviceLoader(dataset, batch_size, sampler, device)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, **loader_options(args, device))


def make_loaders(args, device, train_ds, val_ds, test_ds, replicas=None, replica=0):
    """(train sampler, train loader, val loader or None, test loader). replicas=None: one process reads everything;
    else data-parallel replica `replica` of `replicas` reads its shard."""
    if replicas is None:
        train_sampler = RandomSampler(train_ds, generator=torch.Generator())  # reseeded every epoch (shuffle)
        evaluation = SequentialSampler
    else:
        train_sampler = DistributedSampler(train_ds, num_replicas=replicas, rank=replica, shuffle=True, seed=args.seed)
        # EvalSampler: every image on exactly one replica (DistributedSampler would pad with duplicates); sums.
        evaluation = partial(EvalSampler, num_replicas=replicas, rank=replica)
    val_loader = make_loader(args, val_ds, args.test_batch_size, evaluation(val_ds), device) if val_ds else None
    return (train_sampler, make_loader(args, train_ds, args.batch_size, train_sampler, device), val_loader,
            make_loader(args, test_ds, args.test_batch_size, evaluation(test_ds), device))


def shuffle(sampler, args, epoch: int) -> None:
    """A new, reproducible order each epoch (under torchrun: the same on every rank)."""
    if isinstance(sampler, DistributedSampler):
        sampler.set_epoch(epoch)
    else:
        sampler.generator.manual_seed(args.seed + epoch)
