"""Lesson 05 measured on GPUs: FSDP2 trains a model DDP cannot fit, what its tools cost, and where its time goes.

One command on a machine with 2 GPUs (4 when present), from the course folder, within --budget-s (default 420 s):

    python benchmarks/fsdp_gpu.py --data-dir .mnist --commit abc1234 --out OUT               # 2 GPUs: ~6 min
    python benchmarks/fsdp_gpu.py --data-dir .mnist --commit abc1234 --out OUT --budget-s 540  # 4 GPUs: ~8 min
    python benchmarks/fsdp_gpu.py --cpu-smoke --out /tmp/fsdp-smoke     # the same logic on CPU/gloo, tiny (~1 min)

writes OUT/fsdp_gpu.json, OUT/fsdp_gpu.md, OUT/fsdp_memory.png, OUT/fsdp_trace.json (part d) and OUT/logs/ (every
run's output). Results are rewritten after every run: a killed command keeps what it measured. In order of
importance, so that the budget cuts the least important (a run that no longer fits is recorded as skipped):

  a. OOM against fits. Under a per-process cap of --cap-gib (6) GiB per GPU (torch.cuda.set_per_process_memory_fraction,
     set by this file in each process before the script runs: a smaller card), lesson 04 (DDP) and lesson 05 (FSDP2),
     the real scripts under torchrun, train the same model: AdamW lr 1e-4, 30 steps, data on the GPUs, --blocks B
     --hidden 6144. B comes from arithmetic: DDP keeps 16 bytes per parameter on EVERY GPU (weights 4 + gradients 4
     + AdamW 8), so B is the smallest with 16 P > 1.05 cap (B = 10, 434 M parameters, 6.5 GiB); FSDP keeps 16 P / N
     plus about two gathered units. DDP's error line verbatim; FSDP's peak, s/step and test accuracy, on 2 and 4 GPUs.
  b. The memory curve: fsdp_memory.py --sweep over sizes up to B at N = 1, 2 (4): DDP, FSDP2, FSDP2 + activation
     checkpointing, FSDP2 + CPU offload; peak memory per GPU against parameters -> fsdp_memory.png.
  c. The tools on 2 GPUs: activation checkpointing on the activation-heavy --width 8 at batch 512;
     reshard_after_forward=False and --prefetch against the default at B; CPU offload on ONE capped GPU at B, 2B, 4B
     (and plain FSDP at B, which does not fit).
  d. Where the time goes at width 1: FSDP2's s/step against DDP's as --hidden grows (4 blocks, batch 512); a
     torch.profiler trace of 3 FSDP2 steps of the classic model, its NCCL kernels against the rest; lessons 04 and
     05 themselves, s/epoch.
The uncapped runs of b, c and d at N GPUs share ONE fsdp_memory.py launch (a process start costs ~15 s).

Measured on 2 x H100 80GB (synthetic data, 2026-11-26): a 65 s, b+c+d at N = 1 and 2 175 s, c's offload 69 s,
d's lessons 41 s: 353 s. 4 GPUs add a 4-GPU lesson 05 run (~40 s) and a 4-GPU sweep (~60 s).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import runpy
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"04": ROOT / "04_ddp_training" / "mnist_ddpmodel.py", "05": ROOT / "05_multigpu_fsdp_training" /
           "mnist_fsdpmodel.py", "mem": ROOT / "05_multigpu_fsdp_training" / "fsdp_memory.py"}
WORKER = "--as-rank"  # torchrun runs this file again with it: cap the memory, then run the script
GiB, MiB = 2 ** 30, 2 ** 20
LESSON_FLAGS = ["--optimizer", "adamw", "--lr", "1e-4", "--epochs", "1", "--max-steps", "30", "--data-on-device",
                "--num-workers", "0"]
VARIANTS = ("ddp", "fsdp", "checkpoint-activations", "cpu-offload")  # part b's lines


# ---- inside each training process ------------------------------------------------------------------------
def as_rank(argv):
    """`fsdp_gpu.py --as-rank SCRIPT CAP_GIB FAKE_OOM ARGS...`: cap this process's GPU memory, run the script."""
    script, cap_gib, fake_oom, rest = argv[0], float(argv[1]), argv[2] == "1", argv[3:]
    import torch
    if cap_gib > 0 and torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0"))
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GiB / total), device=index)
    if fake_oom:  # --cpu-smoke only: the first AdamW step fails as a capped GPU would, inside the real script
        def out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 1.00 GiB (SIMULATED by --cpu-smoke, "
                                         f"cap {cap_gib} GiB)")
        torch.optim.AdamW.step = out_of_memory
    sys.argv = [str(SCRIPTS[script]), *rest]
    sys.path.insert(0, str(ROOT))
    runpy.run_path(str(SCRIPTS[script]), run_name="__main__")


# ---- sizes and the arithmetic of part a -------------------------------------------------------------------
def sizes(blocks: int, hidden: int, width: int = 1) -> dict:
    """Parameters of Net(width, blocks, hidden) and of its largest FSDP unit, counted on the meta device."""
    import torch
    from common.model import Net
    with torch.device("meta"):
        net = Net(width, blocks, hidden)
    units = [net.features, net.fc1, *net.blocks, net.fc2]
    return {"parameters": sum(p.numel() for p in net.parameters()),
            "largest_unit": max(sum(p.numel() for p in u.parameters()) for u in units)}


def choose_blocks(cap_bytes: float, hidden: int) -> int:
    """The smallest --blocks whose weights + gradients + AdamW state (16 B per parameter) pass 1.05 x the cap.

    Few wide blocks, not many narrow ones: each Block adds x + relu(fc(x)), which grows the activations' variance
    by about 7/6 at the default init, so 97 blocks of 2048 (measured: loss 1e7 after 30 steps, 10% accuracy) do not
    train in 30 steps at lr 1e-4, and 10 of 6144 (variance x 4.7) do; fewer units are also fewer collectives."""
    base, per_block = sizes(0, hidden)["parameters"], hidden * hidden + hidden
    return max(1, math.ceil((1.05 * cap_bytes / 16 - base) / per_block))


def predict(blocks: int, hidden: int, n: int, data_bytes: int) -> dict:
    """Peak bytes per GPU: the course's arithmetic, and with what the lesson scripts add."""
    s = sizes(blocks, hidden)
    p, u = s["parameters"], s["largest_unit"]
    return {**s, "ddp_16P": 16 * p, "fsdp_16P_over_N_plus_2_units": 16 * p // n + 2 * 4 * u,
            # + the data set, held on the GPU by --data-on-device
            "ddp_full": 16 * p + data_bytes, "fsdp_full": 16 * p // n + 2 * 4 * u + data_bytes}


# ---- the orchestrating process ---------------------------------------------------------------------------
class Bench:
    def __init__(self, o):
        self.o, self.out, self.start = o, Path(o.out), time.monotonic()
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        sys.path.insert(0, str(ROOT))
        from benchmarks.report import machine_info
        self.machine = machine_info(o.cpu_smoke, o.commit)
        self.machine.update(gpus=o.gpus, gpu_memory_mib=gpu_memory_mib())
        self.result = {"machine": self.machine, "options": {k: str(v) for k, v in vars(o).items()},
                       "a": {}, "b": [], "c": {}, "d": {}, "runs": [], "notes": []}

    def left(self) -> float:
        return self.o.budget_s - (time.monotonic() - self.start)

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.start:5.0f} s] {text}", flush=True)

    def launch(self, name, script, nproc, args, cap_gib=0.0, fake_oom=False, timeout=150.0) -> dict:
        """One torchrun (or, for one process, python) of `script` under the cap; its run record, also kept."""
        o = self.o
        run = {"name": name, "script": script, "nproc": nproc, "cap_gib": cap_gib or None, "args": list(map(str, args)),
               **{k: self.machine.get(k) for k in ("gpu", "driver", "torch", "commit")}}
        timeout = min(timeout * (0.5 if o.cpu_smoke else 1.0), self.left())
        if timeout < (5 if o.cpu_smoke else 20):
            self.say(f"{name}: skipped, out of --budget-s")
            return self._keep({**run, "status": "skipped (out of --budget-s)", "rows": [], "output": ""})
        launcher = [sys.executable] if nproc == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        cmd = [*launcher, str(Path(__file__).resolve()), WORKER, script, str(cap_gib), "1" if fake_oom else "0",
               *map(str, args)]
        threads = 1 if o.cpu_smoke else max(1, min(8, (os.cpu_count() or 8) // nproc))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads), "DIST_TIMEOUT_SECONDS": "120"}
        if not o.cpu_smoke:  # the first nproc GPUs (of those already made visible, if any)
            visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(o.gpus)))
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible.split(",")[:nproc])
        self.say(f"{name}: {script} on {nproc} {'process' if o.cpu_smoke else 'GPU'}(s)"
                 f"{f', cap {cap_gib} GiB' if cap_gib else ''} (up to {timeout:.0f} s) ...")
        began, cpu, log = time.monotonic(), children_cpu_s(), self.out / "logs" / f"{name}.log"
        with open(log, "w") as f:  # its own session: on a timeout torchrun and its workers are stopped together
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                rc = None
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        output = log.read_text(errors="replace")
        rows = [json.loads(line) for line in output.splitlines() if line.startswith('{"rank"') and line.endswith("}")]
        error = next((line.strip() for line in output.splitlines() if line.startswith("error: ")), None)
        status = "ok" if rc == 0 else "timeout" if rc is None else \
            "out of memory" if error and "out of memory" in error else f"failed (exit {rc})"
        run.update(status=status, seconds=round(time.monotonic() - began, 1), cpu_s=round(children_cpu_s() - cpu, 1),
                   error=error, rows=rows, output=output)
        self.say(f"{name}: {status} in {run['seconds']} s" + (f"\n    {error}" if error else ""))
        return self._keep(run)

    def lesson(self, name, lesson, nproc, flags, cap_gib=0.0, fake_oom=False, timeout=150.0) -> dict:
        """A lesson script in a fresh output folder; adds what its metrics.json says."""
        run_dir = self.out / "runs" / name
        shutil.rmtree(run_dir, ignore_errors=True)
        run = self.launch(name, lesson, nproc, [*self.data_flags(), *flags, "--output-dir", run_dir],
                          cap_gib, fake_oom, timeout)
        metrics = run_dir / "metrics.json"
        if metrics.exists():
            m = json.loads(metrics.read_text())
            epochs = m["epochs"]
            best = min(epochs[1:] or epochs, key=lambda e: e["epoch_seconds"])  # the first pays one-off costs
            images = round(best["train_images_per_second"] * best["epoch_seconds"])  # of all ranks
            steps = math.ceil(images / nproc / m["args"]["batch_size"])
            run.update(peak_bytes=m["peak_memory_bytes"], s_per_epoch=best["epoch_seconds"], steps=steps,
                       s_per_step=best["epoch_seconds"] / steps, test_accuracy=epochs[-1]["test_accuracy"],
                       warmup_s=m["warmup_seconds"], train_loss=epochs[-1]["train_loss"])
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # GBs at these sizes; the disk is small
        (run_dir / "model_full.pt").unlink(missing_ok=True)
        return self._keep(run, replace=True)

    def memory(self, name, nproc, sweep, steps, cap_gib=0.0, extra=(), timeout=150.0) -> dict:
        """fsdp_memory.py --sweep: its rows, one per config, merged over the ranks."""
        run = self.launch(name, "mem", nproc, ["--sweep", sweep, "--steps", steps, *self.device_flags(), *extra],
                          cap_gib, timeout=timeout)
        merged = {}
        for r in run["rows"]:
            key = (r["group"], r["tools"], r["width"], r["blocks"], r["hidden"], r["batch_size"])
            m = merged.setdefault(key, {**r, "ranks": 0})
            m["ranks"] += 1
            for k in ("held_bytes", "peak_bytes", "s_per_step"):  # the largest rank's bytes, the slowest's time
                m[k] = max(m.get(k) or 0, r.get(k) or 0) or None
            if r["status"] != "ok":
                m["status"] = r["status"]
        run["configs"] = [{k: v for k, v in m.items() if k != "rank"} for m in merged.values()]
        return self._keep(run, replace=True)

    def data_flags(self) -> list:
        smoke = ["--train-samples", 128, "--test-samples", 64] if self.o.cpu_smoke else []
        return ["--data", self.o.data, "--data-dir", self.o.data_dir, *smoke, *self.device_flags()]

    def device_flags(self) -> list:
        return ["--device", "cpu"] if self.o.cpu_smoke else []

    def _keep(self, run, replace=False) -> dict:
        if replace:
            self.result["runs"] = [r for r in self.result["runs"] if r["name"] != run["name"]]
        self.result["runs"].append(run)
        self.write()
        return run

    def write(self):
        saved = {**self.result, "runs": [{k: v for k, v in r.items() if k != "output"} for r in self.result["runs"]]}
        tmp = self.out / "fsdp_gpu.json.tmp"
        tmp.write_text(json.dumps(saved, indent=1))
        tmp.replace(self.out / "fsdp_gpu.json")  # a kill never leaves half a file
        (self.out / "fsdp_gpu.md").write_text(markdown(self.result))


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # of the finished runs: their CPU seconds, all processes
    return usage.ru_utime + usage.ru_stime


def gpu_memory_mib():
    try:  # nvidia-smi, not torch: this process holds no CUDA context (it would sit on GPU 0 for the whole run)
        text = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30).stdout.split("\n")[0].strip()
        return int(text) if text else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


# ---- the four parts ----------------------------------------------------------------------------------------
def part_a(bench, hidden, blocks, data_bytes):
    """DDP out of memory, FSDP trains, under the same cap; the size is adjusted (twice at most) if the arithmetic missed."""
    o, a = bench.o, bench.result["a"]
    for attempt in range(3):
        flags = [*LESSON_FLAGS, "--blocks", blocks, "--hidden", hidden]
        a.update(blocks=blocks, hidden=hidden, cap_gib=o.cap_gib,
                 predicted={n: predict(blocks, hidden, n, data_bytes) for n in (1, 2, 4)})
        ddp = bench.lesson(f"a-ddp-N2-b{blocks}", "04", 2, flags, o.cap_gib, fake_oom=o.cpu_smoke)
        a["ddp"] = summary(ddp)
        if ddp["status"] == "ok":  # DDP fitted after all: a larger model
            bench.result["notes"].append(f"a: DDP still fitted at --blocks {blocks}; trying {math.ceil(blocks * 1.25)}")
            blocks = math.ceil(blocks * 1.25)
            continue
        fsdp = bench.lesson(f"a-fsdp-N2-b{blocks}", "05", 2, flags, o.cap_gib)
        a["fsdp_N2"] = summary(fsdp)
        if fsdp["status"] == "out of memory" and attempt < 2:  # neither fits: a smaller one
            bench.result["notes"].append(f"a: FSDP did not fit either at --blocks {blocks}; trying {int(blocks * 0.9)}")
            blocks = int(blocks * 0.9)
            continue
        break
    if o.gpus >= 4:
        a["fsdp_N4"] = summary(bench.lesson(f"a-fsdp-N4-b{blocks}", "05", 4, flags, o.cap_gib))
    return blocks


def summary(run) -> dict:
    keep = ("name", "status", "error", "seconds", "peak_bytes", "s_per_step", "steps", "train_loss", "test_accuracy",
            "warmup_s", "s_per_epoch")
    return {k: run.get(k) for k in keep}


def sweeps(bench, hidden, blocks):
    """b, and the uncapped halves of c and d: ONE fsdp_memory.py launch per N (process starts cost ~15 s on GPUs).

    Its groups run in order of importance: b's curve; at N = 2 then c's tools and d's FSDP2-against-DDP sizes,
    and last the classic width-1 model, profiled. A launch cut by the budget keeps the configs it measured."""
    o, smoke = bench.o, bench.o.cpu_smoke
    sizes_b = [0, blocks] if smoke else sorted({0, blocks // 8, blocks // 4, blocks // 2, blocks})
    variants = [v for v in VARIANTS if not (smoke and v == "cpu-offload")]  # offload needs GPUs
    batch, width = (16, 1) if smoke else (512, 8)
    groups = {"b": f"blocks={','.join(map(str, sizes_b))};hidden={hidden};tools={','.join(variants)}"
                   f";steps={2 if smoke else 4}" + (";batch_size=16" if smoke else ""),
              # c: activation checkpointing where ACTIVATIONS dominate; ZeRO-2 and prefetch at part a's size
              "c": f"width={width};batch_size={batch};steps={2 if smoke else 8};tools=fsdp,checkpoint-activations|"
                   f"blocks={blocks};hidden={hidden};steps={2 if smoke else 8};tools=fsdp,no-reshard-after-forward,prefetch"
                   + (";batch_size=16" if smoke else ""),
              # d: FSDP2 against DDP as --hidden grows; then the classic model, whose last 3 steps are profiled
              "d": f"blocks=4;batch_size={batch};hidden={'64,128' if smoke else '256,512,1024,2048,4096,8192,16384'};"
                   f"steps={2 if smoke else 12};tools=ddp,fsdp|batch_size={batch};steps={5 if smoke else 10};tools=fsdp"}
    trace = bench.out / "fsdp_trace.json"
    if smoke:
        bench.result["notes"].append("--cpu-smoke: no cpu-offload (GPUs only), no part c offload run, no part d "
                                     "lesson runs (the code of part a's)")
    # --cpu-smoke: 3 processes stand in for 4 GPUs, and their uneven shards test the bytes per rank harder
    for n in [1, 2, 3] if smoke else [n for n in (1, 2, 4) if n <= o.gpus]:
        parts = [p for p in ("bcd" if n == 2 else "b") if p in o.parts]
        if not parts:
            continue
        run = bench.memory(f"sweep-N{n}", n, "|".join(groups[p] for p in parts), 4,
                           extra=["--profile", trace] if n == 2 else [], timeout=400 if n == 2 else 200)
        owner = [p for p in parts for _ in groups[p].split("|")]  # the part of each group, by the group's number
        for x in run["configs"]:
            if owner[x["group"]] == "b":
                bench.result["b"].append({**x, "world_size": n})
            elif owner[x["group"]] == "c":
                bench.result["c"].setdefault("tools_N2", []).append(x)
            elif x["blocks"] == 4:
                bench.result["d"].setdefault("configs", []).append(x)
            else:
                bench.result["d"]["profile"] = {"trace": trace.name, "s_per_step": x.get("s_per_step"),
                                                **kernels(trace, 3)}
        plot(bench.result, bench.out / "fsdp_memory.png")
        time_ratios(bench.result["d"])
        bench.write()


def time_ratios(d):
    """FSDP2's s/step over DDP's for each --hidden of part d, and the first --hidden where it is at most 1.2."""
    times = {}
    for x in d.get("configs", []):
        times.setdefault(x["hidden"], {})[x["tools"]] = x.get("s_per_step")
    d["fsdp_over_ddp"] = [{"hidden": h, "blocks": 4, **sizes(4, h), "ddp_s": t.get("ddp"), "fsdp_s": t.get("fsdp"),
                           "ratio": t["fsdp"] / t["ddp"] if t.get("ddp") and t.get("fsdp") else None}
                          for h, t in times.items()]
    d["within_1_2x_at_hidden"] = next((r["hidden"] for r in d["fsdp_over_ddp"] if r["ratio"] and r["ratio"] <= 1.2),
                                      None)


def offload(bench, hidden, blocks):
    """c: CPU offload on ONE GPU under the cap. Plain FSDP at B should not fit (16 B per parameter on the GPU); with
    offload the GPU holds about one unit at a time, so the limit moves to CPU memory and AdamW's time on the CPU."""
    c, grow = bench.result["c"], ",".join(str(blocks * k) for k in (1, 2, 4))
    run = bench.memory("c-offload-N1", 1, f"blocks={blocks};hidden={hidden};tools=fsdp|blocks={grow};hidden={hidden};"
                       f"tools=cpu-offload", 3, bench.o.cap_gib, timeout=240)
    c["offload_N1"] = run["configs"]
    if not run["configs"]:
        bench.result["notes"].append(f"c: the offload run: {run['status']} {run.get('error') or ''}")
    fits = [x["blocks"] for x in run["configs"] if x["tools"] == "cpu-offload" and x["status"] == "ok"]
    c["offload_largest_blocks"] = max(fits, default=None)
    bench.write()


def lessons_w1(bench):
    """d: lessons 04 and 05 themselves at the classic size, 2 epochs, data on the GPUs: s/epoch."""
    flags = ["--data-on-device", "--batch-size", 512, "--epochs", 2, "--num-workers", 0]
    for lesson in ("04", "05"):
        bench.result["d"][f"lesson{lesson}_w1"] = summary(bench.lesson(f"d-lesson{lesson}-w1-N2", lesson, 2, flags,
                                                                       timeout=90))
        bench.write()


def kernels(trace: Path, steps: int) -> dict:
    """GPU kernels per step in a chrome trace: NCCL all-gather / reduce-scatter / all-reduce against the rest."""
    if not trace.exists():
        return {"kernels": None}
    kinds = {}
    for event in json.loads(trace.read_text())["traceEvents"]:
        if event.get("cat") == "kernel":
            name = event["name"].lower().replace("_", "")
            kind = next((k for k in ("allgather", "reducescatter", "allreduce") if k in name), "other")
            count, us = kinds.get(kind, (0, 0.0))
            kinds[kind] = (count + 1, us + float(event.get("dur", 0)))
    return {"kernels": {k: {"per_step": round(n / steps, 1), "ms_per_step": round(us / steps / 1e3, 3)}
                        for k, (n, us) in sorted(kinds.items())},
            "gpu_busy_ms_per_step": round(sum(us for _, us in kinds.values()) / steps / 1e3, 3)}


# ---- the page and the plot ---------------------------------------------------------------------------------
def mib(x) -> str:
    return "-" if not x else f"{x / MiB:,.0f}"


def markdown(s) -> str:
    m, a, c, d = s["machine"], s["a"], s["c"], s["d"]
    lines = ["# FSDP2: fitting a model DDP cannot", "",
             f"{m.get('gpus')} x {m.get('gpu')} ({m.get('gpu_memory_mib') or '-'} MiB), driver {m.get('driver')}, torch "
             f"{m.get('torch')}, course commit {m.get('commit')}, {m.get('date')}. Data: "
             f"{'real MNIST' if s['options'].get('data') == 'mnist' else 'synthetic'}. fp32, AdamW. Peak = "
             "`torch.cuda.max_memory_allocated`; held = parameters + gradients + optimizer state this rank stores.", ""]
    if a:
        pred = {int(n): v for n, v in a["predicted"].items()}  # JSON turns the keys into strings
        p = pred[2]
        lines += [f"## a. Out of memory against fits: --blocks {a['blocks']} --hidden {a['hidden']}, "
                  f"{p['parameters'] / 1e6:,.1f} M parameters, cap {a['cap_gib']} GiB per GPU", "",
                  "Predicted peak per GPU: the course's arithmetic (DDP 16 B x P; FSDP 16 B x P / N + two gathered "
                  "units of the largest, fc1) and in full (+ the data set, held on the GPU).", "",
                  "| run | GPUs | status | predicted MiB (arithmetic / full) | peak MiB (rank 0) | s/step | "
                  "train loss | test accuracy |", "|---|---|---|---|---|---|---|---|"]
        for key, n in (("ddp", 2), ("fsdp_N2", 2), ("fsdp_N4", 4)):
            r = a.get(key)
            if r:
                guess = (pred[n]["ddp_16P"], pred[n]["ddp_full"]) if key == "ddp" else \
                    (pred[n]["fsdp_16P_over_N_plus_2_units"], pred[n]["fsdp_full"])
                failed = re.search(r"\(([\d.]+) GiB were allocated\)", r.get("error") or "")
                peak = f"{float(failed.group(1)) * 1024:,.0f} when it failed" if failed else mib(r.get("peak_bytes"))
                lines.append(f"| {r['name']} | {n} | {r['status']} | {mib(guess[0])} / {mib(guess[1])} | {peak} | "
                             f"{_f(r.get('s_per_step'))} | {_f(r.get('train_loss'))} | {r.get('test_accuracy') or '-'} |")
        if a.get("ddp", {}).get("error"):
            lines += ["", "DDP's error, verbatim:", "", "```", a["ddp"]["error"], "```"]
    if s["b"]:
        lines += ["", "## b. Peak memory per GPU against parameters (fsdp_memory.py --sweep)", "",
                  "| N | tools | blocks | parameters | held MiB/rank | peak MiB/GPU | s/step | status |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [config_line(x, first="world_size") for x in s["b"]]
    if c:
        lines += ["", "## c. The tools on GPUs", "", "| N | tools | width | blocks | batch | parameters | held MiB/rank | "
                  "peak MiB/GPU | s/step | status |", "|---|---|---|---|---|---|---|---|---|---|"]
        for x in c.get("tools_N2", []) + c.get("offload_N1", []):
            lines.append(config_line(x, first="world_size", extra=("width", "blocks", "batch_size")))
        if "offload_largest_blocks" in c:
            lines += ["", f"Largest --blocks trained with CPU offload on ONE GPU capped at {s['a'].get('cap_gib')} GiB: "
                      f"{c['offload_largest_blocks']} (tried 1, 2 and 4 x part a's)."]
    if d:
        lines += ["", "## d. Where the time goes at width 1", ""]
        for key in ("lesson04_w1", "lesson05_w1"):
            if d.get(key):
                r = d[key]
                lines.append(f"- {r['name']}: {r['status']}, best s/epoch {_f(r.get('s_per_epoch'))}, "
                             f"test accuracy {r.get('test_accuracy') or '-'}")
        if d.get("fsdp_over_ddp"):
            lines += ["", "| --hidden (4 blocks) | parameters | DDP s/step | FSDP2 s/step | FSDP2 / DDP |", "|---|---|---|---|---|"]
            lines += [f"| {r['hidden']} | {r['parameters'] / 1e6:,.1f} M | {_f(r['ddp_s'])} | {_f(r['fsdp_s'])} | "
                      f"{_f(r['ratio'], 2)} |" for r in d["fsdp_over_ddp"]]
            lines += ["", f"FSDP2 within 1.2x of DDP from --hidden {d.get('within_1_2x_at_hidden')} on (None: not in the sweep)."]
        if d.get("profile"):
            pr = d["profile"]
            lines += ["", f"Profile of 3 FSDP2 steps at width 1 ({pr['trace']}), s/step {_f(pr['s_per_step'])}; GPU "
                      "kernels per step: " + ("none (a CPU run)" if not pr.get("kernels") else "; ".join(
                          f"{k} {v['per_step']} kernels, {v['ms_per_step']} ms" for k, v in pr["kernels"].items())
                          + f"; all kernels together {pr['gpu_busy_ms_per_step']} ms of the step's "
                          f"{1e3 * (pr['s_per_step'] or 0):.1f} ms (kernels on several streams overlap)")]
    runs = [r for r in s["runs"] if r["status"] not in ("ok", "out of memory")]
    if runs:
        lines += ["", "## Runs that did not end well (last lines in logs/)", ""]
        lines += [f"- {r['name']}: {r['status']}{': `' + r['error'] + '`' if r.get('error') else ''}" for r in runs]
    if s["notes"]:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in s["notes"]]
    return "\n".join(lines) + "\n"


def _f(x, digits=4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def config_line(x, first, extra=("blocks",)) -> str:
    return (f"| {x[first]} | {x['tools']} | " + " | ".join(str(x[k]) for k in extra) +
            f" | {(x.get('parameters') or 0) / 1e6:,.1f} M | {mib(x.get('held_bytes'))} | {mib(x.get('peak_bytes'))} | "
            f"{_f(x.get('s_per_step'))} | {x['status']} |")


def plot(result, path: Path) -> None:
    """Left: peak GPU memory per GPU; right: what each rank holds; one line per variant and N; log-x."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return result["notes"].append("no matplotlib: fsdp_memory.png not drawn")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in zip(axes, ("peak_bytes", "held_bytes"), ("peak GPU memory per GPU",
                                                                    "parameters + gradients + AdamW held per rank")):
        lines = {}
        for x in result["b"]:
            if x["status"] == "ok" and x.get(key):
                lines.setdefault((x["tools"], x["world_size"]), []).append((x["parameters"], x[key] / GiB))
        for (tools, n), points in sorted(lines.items()):  # colour: the variant; line and marker: N
            ax.plot(*zip(*sorted(points)), color=f"C{VARIANTS.index(tools) if tools in VARIANTS else 9}",
                    marker={1: "o", 2: "s"}.get(n, "^"), ls={1: "-", 2: "--"}.get(n, ":"), label=f"{tools}, N={n}")
        if key == "peak_bytes" and result["a"].get("cap_gib") and lines:
            ax.axhline(result["a"]["cap_gib"], color="red", lw=1, label=f"cap {result['a']['cap_gib']} GiB")
        if not lines:
            ax.text(0.5, 0.5, "not measured (CPU run)", ha="center", va="center", transform=ax.transAxes)
        else:
            ax.set_xscale("log")
            ax.legend(fontsize=7)
        ax.set(xlabel="parameters", ylabel="GiB", title=title)
    fig.suptitle(f"{result['machine'].get('gpu')}, torch {result['machine'].get('torch')}, "
                 f"commit {result['machine'].get('commit')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == WORKER:
        return as_rank(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for fsdp_gpu.json, .md, fsdp_memory.png, logs/, runs/")
    p.add_argument("--cpu-smoke", action="store_true", help="CPU, gloo, tiny sizes, simulated OOM: checks the logic")
    p.add_argument("--data-dir", default=None, help="real MNIST (MNIST/raw/*.gz or extracted); default: synthetic")
    p.add_argument("--cap-gib", type=float, default=None, help="memory cap per GPU for a and c (default: 6)")
    p.add_argument("--hidden", type=int, default=None, help="--hidden of the parameter-heavy model (default: 6144)")
    p.add_argument("--blocks", type=int, default=None, help="--blocks for part a (default: from the arithmetic)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use, 2 or 4 (default: all visible, at most 4)")
    p.add_argument("--parts", default="abcd", help="which parts, in this order (default: abcd)")
    p.add_argument("--budget-s", type=float, default=420.0, help="seconds for everything (default: 420)")
    p.add_argument("--commit", default=os.environ.get("BENCH_COMMIT"), help="course commit (default: git, else ?)")
    o = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if o.cpu_smoke:
        o.gpus, o.cap_gib, o.hidden = o.gpus or 2, o.cap_gib or 0.0375, o.hidden or 256  # -> --blocks 4
    else:
        import torch
        o.gpus = min(4, o.gpus or torch.cuda.device_count())
        if o.gpus < 2:
            raise SystemExit("fsdp_gpu: needs 2 GPUs (4 when present); use --cpu-smoke on a machine without")
        o.cap_gib, o.hidden = o.cap_gib or 6.0, o.hidden or 6144
    o.gpus = 4 if o.gpus >= 4 else 2
    from common.data import prepare_data
    o.data = "mnist" if o.data_dir else "synthetic"
    o.out = str(Path(o.out).resolve())  # the runs start in the course folder: no path may be relative
    o.data_dir = str(Path(o.data_dir or Path(o.out) / "data").resolve())
    prepare_data(o.data_dir, o.data, download=False)  # once, here: the ranks never race to extract the .gz files
    bench = Bench(o)
    images = (128 + 64) if o.cpu_smoke else 70_000
    data_bytes = images * 28 * 28 * 4  # the data set on each GPU (--data-on-device), float32
    blocks = o.blocks or choose_blocks(o.cap_gib * GiB, o.hidden)
    bench.say(f"{o.gpus} {'processes (CPU smoke)' if o.cpu_smoke else 'GPUs'}, cap {o.cap_gib} GiB, --hidden {o.hidden}"
              f" --blocks {blocks}: {sizes(blocks, o.hidden)['parameters'] / 1e6:,.1f} M parameters, "
              f"DDP needs 16 B x P = {16 * sizes(blocks, o.hidden)['parameters'] / GiB:.2f} GiB; budget {o.budget_s:.0f} s")
    if "a" in o.parts:
        blocks = part_a(bench, o.hidden, blocks, data_bytes)
    if set("bcd") & set(o.parts):  # b, with c's and d's uncapped runs at N = 2
        sweeps(bench, o.hidden, blocks)
    if "c" in o.parts and not o.cpu_smoke:
        offload(bench, o.hidden, blocks)
    if "d" in o.parts and not o.cpu_smoke:
        lessons_w1(bench)
    bench.say(f"done: {bench.out / 'fsdp_gpu.md'}")
    print((bench.out / "fsdp_gpu.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
