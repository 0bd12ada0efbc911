"""The training loop every strategy runs: epochs of train() and test(), a checkpoint at each epoch's end and on a
stop request, early stopping, metrics.json. A strategy module (trainer/single.py ... pp.py) builds and wraps the
model and hands Run what differs: its checkpoint format (trainer/state.py), its no_sync and clip_grad_norm, whether
this rank's numbers count; pp's pipeline steps its own train() and test() (trainer/pp.py)."""
import os
import signal
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.config import save_config
from common.early_stopping import should_stop
from common.history import History
from common.metrics import EpochMeter
from common.position import Position, steps_per_epoch
from common.signals import StopSignals
from trainer.data import shuffle
from trainer.optim import make_optimizer, make_scheduler
from trainer.warmup import warm_up


class Run:
    """One run: the model as the strategy built it, its data, optimizer, schedule, checkpoints and position.

    loaders: make_loaders' (train sampler, train, val or None, test). replicas: the data-parallel ones, for
    --lr-scaling. stop_group: under torchrun, the gloo group of the stop votes (None: one process, no vote).
    no_sync: a context without gradient communication (--grad-accum's first micro-batches). counted: this rank's
    losses and images count (TP peers compute the same ones: one counts). join: under FSDP2 a rank with fewer test
    batches joins the others' gathers."""

    def __init__(self, args, lesson, device, model, loaders, checkpoints, state, resume, replicas=1, amp_dtype=None,
                 stop_group=None, no_sync=None, clip_grad_norm=torch.nn.utils.clip_grad_norm_, counted=True,
                 join=False, scaler=True, warm=True):
        self.args, self.device, self.model, self.amp_dtype = args, device, model, amp_dtype
        self.train_sampler, self.train_loader, self.val_loader, self.test_loader = loaders
        self.checkpoints, self.state, self.stop_group, self.stop = checkpoints, state, stop_group, None
        self.no_sync, self.clip_grad_norm, self.counted, self.join = no_sync, clip_grad_norm, counted, join
        # --amp fp16 needs loss scaling (pp refuses float16: scaler=False)
        self.scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16) if scaler else None
        self.optimizer = make_optimizer(args, model.parameters(), replicas)  # --optimizer, --lr (default: Adadelta)
        self.scheduler = make_scheduler(args, self.optimizer, steps_per_epoch(self.train_loader, args))  # --schedule
        # a collective under torchrun: every rank calls it (its steps are training steps)
        warmup_s = warm_up(model, self.optimizer, self.train_loader, device, args, amp_dtype) if warm else 0.0
        self.position, self.history = Position(), History(args, lesson, device, warmup_seconds=warmup_s)
        if resume:  # --resume auto: the newest good checkpoint
            state.load(resume, self)
        save_config(args, f"{args.output_dir}/config.yaml")  # --config this file replays the run

    def stopping(self, now: bool = False) -> bool:
        """Ctrl-C or SIGTERM (Slurm: SIGUSR1 too) arrived. One process: looked at every step. Under torchrun every
        rank stops at the same step: a vote every 10 steps, and now=True (an epoch's end) waits for its result."""
        if self.stop_group is None:
            return bool(self.stop.request)
        # a collective (all_reduce): every rank calls it
        return (now or self.position.step % 10 == 0) and self.stop.agreed(self.stop_group, now=now)

    def train_epoch(self) -> dict:
        """One epoch, from position.step on. Leaves early, between two steps, when a stop was requested."""
        args, model, device, optimizer, scaler, position = (self.args, self.model, self.device, self.optimizer,
                                                            self.scaler, self.position)
        model.train()
        meter = position.meter(device)  # the epoch's training loss; a resumed epoch continues its own sums
        for i, (data, target) in enumerate(position.remaining(self.train_loader, args)):  # a resumed epoch skips steps
            if i % args.grad_accum == 0 and self.stopping():  # under torchrun a collective (all_reduce): the vote
                break  # between two optimizer steps; the caller saves a checkpoint here
            data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
            sync_now = (i + 1) % args.grad_accum == 0  # the last micro-batch of an optimizer step
            with self.no_sync() if self.no_sync and not sync_now else nullcontext():  # no gradient all_reduce yet
                with torch.autocast(device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                    output = model(data)  # a collective under FSDP2: it all-gathers each unit's weights
                loss = F.nll_loss(output.float(), target)
                # DDP all_reduces (averages) the gradients here, FSDP2 reduce-scatters them: each rank keeps its shard
                scaler.scale(loss / args.grad_accum).backward()  # gradients add up over --grad-accum micro-batches
            if sync_now:
                if args.clip_grad:  # the norm of ALL gradients (sharded: the shards' norms are all-reduced)
                    scaler.unscale_(optimizer)  # float16: clip the true gradients, not the scaled ones
                    self.clip_grad_norm(model.parameters(), args.clip_grad)
                scaler.step(optimizer)  # optimizer.step(); float16: skipped if a gradient overflowed
                scaler.update()  # float16: a smaller scale after an overflow, a larger one after 2000 good steps
                self.scheduler.step()  # the learning rate schedule advances once per optimizer step
                optimizer.zero_grad(set_to_none=True)
                position.step += 1
            if self.counted:  # TP peers computed the same loss on the same batch: it counts once per TP group
                meter.update(loss.detach() * len(data), 0, len(data))  # a SUM, so the epoch's mean is exact
        return meter.all_reduce()

    @torch.no_grad()
    def evaluate(self, loader) -> dict:
        self.model.eval()
        meter, device = EpochMeter(self.device), self.device
        for data, target in loader:
            data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                output = self.model(data)  # a collective under FSDP2: it all-gathers each unit's weights
            if self.counted:  # once per TP group, as in train_epoch()
                loss_sum = F.nll_loss(output.float(), target, reduction="sum")
                meter.update(loss_sum, (output.argmax(dim=1) == target).sum(), len(data))
        for _ in range(loader.sampler.most_batches(loader.batch_size) - len(loader) if self.join else 0):
            self.model(torch.zeros(1, 1, 28, 28, device=device))  # a collective: FSDP gathers INSIDE forward
        return meter.all_reduce()

    def fit(self, export=None) -> dict:
        """The epochs; export(): after one more vote, model_full.pt (fsdp2, tp, 2d, pp). Returns metrics.json's
        numbers, e.g. for a notebook."""
        args, position, history, checkpoints = self.args, self.position, self.history, self.checkpoints
        signals = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C, or Slurm's scancel and time limit
        if self.stop_group is not None:
            signals += (signal.SIGUSR1,)  # + Slurm's warning before the limit
        with StopSignals(*signals) as self.stop:
            for epoch in range(position.epoch, args.epochs + 1):
                shuffle(self.train_sampler, args, epoch)
                if getattr(args, "profile", False):  # --parallel single --profile
                    with profile_steps(self.device):
                        self.train_epoch()
                    break
                train_stats = self.train_epoch()
                # under torchrun a collective (all_reduce), also on a request after the epoch's last vote
                if self.stopping(now=True):  # all ranks save here; the same command with --resume auto continues
                    self.state.save(checkpoints.path(position), self)
                    self.stop.report(position.epoch, position.step)
                    break
                val_stats = self.evaluate(self.val_loader) if self.val_loader else None
                history.add(epoch, train_stats, self.evaluate(self.test_loader), val_stats,
                            self.scheduler.get_last_lr()[0])
                position.next_epoch()
                path = checkpoints.path(position)
                self.state.save(path, self)
                checkpoints.prune(path, best=history.best_epoch == epoch)  # the newest --keep-checkpoints, and best.pt
                if should_stop(history.rows, args.target_accuracy, args.patience):  # the target, or --patience
                    break
            if export:
                history.close()
                # a collective (all_reduce): one more vote, so a request after the last one (in the last test or save)
                # stops every rank or none: a rank that skipped the gather alone would leave the others waiting in it
                if self.stop.agreed(self.stop_group, now=True):
                    self.stop.report(position.epoch, position.step)  # the last epoch's checkpoint is saved; said once
                else:
                    export()  # gathers the full weights: every rank
                dist.destroy_process_group()  # inside the `with`: a late SIGUSR1 is written down, not the end
                return history.record
        history.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        return history.record


@contextmanager
def profile_steps(device, rows=12):
    """--profile: torch.profiler around the enclosed steps, then the top operators and where the wall time went."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # keeps the profiler engine's own start/stop lines quiet
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities, acc_events=True) as prof:
        start = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the GPU work these steps queued belongs to them
        wall = time.perf_counter() - start  # the steps only: starting, stopping and sorting the events excluded
    events = prof.key_averages()
    print(events.table(sort_by=f"{device.type}_time_total", row_limit=rows), flush=True)
    # "Self CPU time total" sums every operator's own time: time inside operators, never the Python between them.
    # The DataLoader's __next__ is recorded as "enumerate(DataLoader)#...": the time the loop waited for a batch.
    data_s = sum(e.cpu_time_total for e in events if e.key.startswith("enumerate(DataLoader)")) / 1e6
    print(f"profile: the profiled steps took {wall:.2f} s of wall-clock time, the profiler's recording included; "
          f"{events.self_cpu_time_total / 1e6:.2f} s were spent inside operators (the table's \"Self CPU time total\")", flush=True)
    print(f"profile: {data_s:.2f} s ({100 * data_s / wall:.0f}% of the wall-clock time) waiting for the DataLoader, "
          f"the rest in forward/backward/optimizer", flush=True)
