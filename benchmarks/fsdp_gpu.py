"""Lesson 05 on GPUs (issue 12, items 5 and 6): explicit prefetch, and the model size where FSDP pays.

One command, about 3-4 minutes on a machine with 2 GPUs, from the course folder:

    python benchmarks/fsdp_gpu.py --out OUT            # writes OUT/fsdp_gpu.json, OUT/fsdp_gpu.md, OUT/logs/
    python benchmarks/fsdp_gpu.py --cpu-smoke --out /tmp/fsdp-smoke   # the same logic on CPU/gloo, tiny (~2 min)

Every run is the real lesson script under `torchrun --standalone --nproc_per_node=2`, synthetic MNIST with the
data held on the GPUs (`--data-on-device`), in a fresh output folder; its metrics.json and the last lines of its
output become a row. Each run has a timeout (--run-timeout) and the whole command a budget (--budget-s): what
does not fit is recorded as skipped. Results are rewritten after every run, so a killed command still leaves
what it measured.

  1. calibrate  lessons 04 (DDP) and 05 (FSDP) at --width 1 and 8, batch 64 per GPU, no cap: s/epoch (best
                epoch after the first), images/s, peak memory per GPU.
  2. memory     the peaks of step 1 give bytes per parameter for DDP and FSDP; with them the
                script picks the smallest --width at which DDP should NOT fit into --cap-gib GiB per GPU while
                FSDP should, then runs both there with the cap applied. The cap is
                torch.cuda.set_per_process_memory_fraction(cap / card memory), set by this script in each
                process before the lesson starts (the lessons themselves are unchanged): an H100 (80 GB) or H200
                (141 GB) would need a model of billions of parameters, minutes just to initialise. DDP's error
                and FSDP's peak are recorded; if the prediction misses, the width is adjusted and run again.
  3. prefetch   lesson 05 at the same widths with --prefetch, against step 1's FSDP runs.
All runs are fp32 (no --amp: FSDP and DDP compare like for like); a last capped FSDP run with --amp shows bf16.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import runpy
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"04": ROOT / "04_ddp_training" / "mnist_ddpmodel.py", "05": ROOT / "05_multigpu_fsdp_training" / "mnist_fsdpmodel.py"}
WORKER = "--as-rank"  # torchrun runs this file again with it: cap the memory, then run the lesson script
MiB = 2 ** 20


# ---- inside each training process ------------------------------------------------------------------------
def as_rank(argv):
    """`fsdp_gpu.py --as-rank LESSON CAP_GIB FAKE_OOM ARGS...`: cap this process's GPU memory, run the lesson."""
    lesson, cap_gib, fake_oom, rest = argv[0], float(argv[1]), argv[2] == "1", argv[3:]
    import torch
    if cap_gib > 0 and torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0"))
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2 ** 30 / total), device=index)
    if fake_oom:  # --cpu-smoke only: what a capped run that does not fit raises, to test the parsing below
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 1.00 GiB (SIMULATED by --cpu-smoke, "
                                     f"cap {cap_gib} GiB)")
    sys.argv = [str(SCRIPTS[lesson]), *rest]
    sys.path.insert(0, str(ROOT))
    runpy.run_path(str(SCRIPTS[lesson]), run_name="__main__")


# ---- the orchestrating process ---------------------------------------------------------------------------
def parameters(width: int) -> int:
    """Net(width)'s parameter count, without building it: conv1, conv2, fc1, fc2 (weights and biases)."""
    c1, c2, h = 32 * width, 64 * width, 128 * width
    return (9 * c1 + c1) + (9 * c1 * c2 + c2) + (c2 * 144 * h + h) + (h * 10 + 10)


class Bench:
    def __init__(self, opts):
        self.opts, self.out = opts, Path(opts.out)
        self.start = time.monotonic()
        self.runs, self.notes = [], []
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        self.data_dir = Path(opts.data_dir or self.out / "data")

    def left(self) -> float:
        return self.opts.budget_s - (time.monotonic() - self.start)

    def run(self, name, lesson, width, extra=(), cap_gib=0.0, fake_oom=False, samples=None):
        """One lesson run under torchrun; returns (and records) its row."""
        o = self.opts
        row = {"name": name, "lesson": lesson, "width": width, "parameters": parameters(width), "flags": list(extra),
               "cap_gib": cap_gib or None, "gpus": o.nproc}
        timeout = min(o.run_timeout, self.left())
        if timeout < 20:
            row.update(status="skipped (out of --budget-s)")
            print(f"[{self.elapsed()}] {name}: skipped, budget spent", flush=True)
            return self._keep(row)
        train, test = samples or (o.train_samples, o.test_samples)
        run_dir = self.out / "runs" / name
        args = ["--data", "synthetic", "--data-dir", self.data_dir, "--train-samples", train, "--test-samples", test,
                "--epochs", o.epochs, "--batch-size", o.batch_size, "--width", width, "--num-workers", 0,
                "--output-dir", run_dir, *extra]
        if not o.cpu_smoke:
            args.append("--data-on-device")
        else:
            args += ["--device", "cpu"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={o.nproc}",
               str(Path(__file__).resolve()), WORKER, lesson, str(cap_gib), "1" if fake_oom else "0", *map(str, args)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if o.cpu_smoke else "4")}
        print(f"[{self.elapsed()}] {name}: lesson {lesson} --width {width} {' '.join(extra)}"
              f"{f' (cap {cap_gib} GiB per GPU)' if cap_gib else ''} ...", flush=True)
        began = time.monotonic()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
            output, rc = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as exc:
            output = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            output += (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            rc = None
        row["seconds"] = round(time.monotonic() - began, 1)
        (self.out / "logs" / f"{name}.log").write_text(output)
        oom = [line.strip() for line in output.splitlines() if "OutOfMemoryError:" in line] or \
            [line.strip() for line in output.splitlines() if "out of memory" in line.lower()]
        row["oom"] = re.sub(r"^\[rank\d+\]:\s*", "", oom[0])[:400] if oom else None
        metrics = run_dir / "metrics.json"
        if rc == 0 and metrics.exists():
            m = json.loads(metrics.read_text())
            epochs = m["epochs"]
            later = epochs[1:] or epochs  # the first epoch pays one-off costs
            best = min(later, key=lambda r: r["epoch_seconds"])
            row.update(status="ok", peak_mib=round(m["peak_memory_bytes"] / MiB) if m["peak_memory_bytes"] else None,
                       s_per_epoch=round(best["epoch_seconds"], 3), images_per_s=round(best["train_images_per_second"]),
                       test_accuracy=epochs[-1]["test_accuracy"], warmup_s=round(m["warmup_seconds"], 2),
                       device=m["device"], torch=m["torch_version"])
            mesh = re.search(r"mesh \(([\d, ]+)\)", output)
            row["mesh"] = mesh.group(1) if mesh else None
        else:
            row.update(status="timeout" if rc is None else ("out of memory" if oom else f"failed (exit {rc})"),
                       tail=output.strip().splitlines()[-6:])
        print(f"[{self.elapsed()}] {name}: {row['status']} in {row['seconds']} s"
              + (f", {row['s_per_epoch']} s/epoch, peak {row['peak_mib'] or '-'} MiB" if row["status"] == "ok" else "")
              + (f"\n    {row['oom']}" if row["oom"] else ""), flush=True)
        return self._keep(row)

    def _keep(self, row):
        self.runs.append(row)
        self.write()
        return row

    def elapsed(self) -> str:
        return f"{time.monotonic() - self.start:5.0f} s"

    # ---- step 2: which width -----------------------------------------------------------------------
    def fit(self, lesson):
        """bytes = a + b * parameters, through the uncapped peaks of `lesson` at the two calibration widths."""
        rows = [r for r in self.runs if r["lesson"] == lesson and r["name"].startswith("calib") and r.get("peak_mib")]
        if len(rows) < 2:
            return None
        (p1, m1), (p2, m2) = sorted((r["parameters"], r["peak_mib"] * MiB) for r in rows)[:2]
        b = (m2 - m1) / (p2 - p1)
        return {"bytes_per_parameter": round(b, 2), "constant_mib": round((m1 - b * p1) / MiB)}

    def choose_width(self, cap_bytes):
        ddp, fsdp = self.fit("04"), self.fit("05")
        if ddp is None or fsdp is None:
            return None, "no peak memory measured (CPU?): no prediction"

        def predict(f, w):
            return f["constant_mib"] * MiB + f["bytes_per_parameter"] * parameters(w)
        for w in range(2, 400):
            if predict(ddp, w) > cap_bytes and predict(fsdp, w) < 0.85 * cap_bytes:
                return w, f"predicted: DDP {predict(ddp, w) / MiB:,.0f} MiB, FSDP {predict(fsdp, w) / MiB:,.0f} MiB"
        for w in range(2, 400):
            if predict(ddp, w) > cap_bytes:
                return w, "no width where FSDP fits and DDP does not was predicted: showing where DDP stops"
        return None, "no prediction"

    def write(self):
        summary = {"machine": machine(), "options": {k: str(v) for k, v in vars(self.opts).items()},
                   "fits": {"04": self.fit("04"), "05": self.fit("05")}, "notes": self.notes, "runs": self.runs}
        (self.out / "fsdp_gpu.json").write_text(json.dumps(summary, indent=2))
        (self.out / "fsdp_gpu.md").write_text(markdown(summary))


def machine() -> dict:
    import torch
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2 ** 30, 1))
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=20).stdout.split("\n")[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def markdown(s) -> str:
    m = s["machine"]
    lines = ["# Lesson 05 on GPUs: prefetch and where FSDP pays", "",
             f"{m.get('gpus')} x {m.get('gpu', 'no GPU (CPU smoke run)')} ({m.get('gpu_memory_gib', '-')} GiB), "
             f"driver {m.get('driver', '-')}, torch {m['torch']}, {time.strftime('%Y-%m-%d')}. "
             f"Synthetic MNIST, data on the GPUs, fp32 unless `--amp`; s/epoch is the best epoch after the first; "
             f"peak = `torch.cuda.max_memory_allocated` on rank 0.", "",
             "| run | lesson | width | parameters | flags | cap GiB | status | s/epoch | images/s | peak MiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["runs"]:
        lines.append(f"| {r['name']} | {r['lesson']} | {r['width']} | {r['parameters'] / 1e6:,.1f} M | "
                     f"{' '.join(r['flags']) or '-'} | {r['cap_gib'] or '-'} | {r['status']} | {r.get('s_per_epoch', '-')} | "
                     f"{r.get('images_per_s', '-')} | {r.get('peak_mib') or '-'} |")
    lines += ["", "Fitted peak = constant + bytes per parameter x parameters (uncapped calibration runs):", ""]
    for lesson, f in s["fits"].items():
        lines.append(f"- lesson {lesson}: {f}")
    ooms = [r for r in s["runs"] if r.get("oom")]
    if ooms:
        lines += ["", "Out-of-memory errors (first line):", ""]
        lines += [f"- {r['name']} (lesson {r['lesson']}, width {r['width']}): `{r['oom']}`" for r in ooms]
    if s["notes"]:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in s["notes"]]
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == WORKER:
        return as_rank(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for fsdp_gpu.json, fsdp_gpu.md, logs/ and runs/")
    p.add_argument("--cpu-smoke", action="store_true", help="CPU, gloo, tiny: checks this script's logic")
    p.add_argument("--nproc", type=int, default=2, help="processes (GPUs) per run (default: 2)")
    p.add_argument("--cap-gib", type=float, default=8.0, help="memory cap per GPU for step 2 (default: 8)")
    p.add_argument("--widths", default="1,8", help="prefetch/calibration widths (default: 1,8)")
    p.add_argument("--train-samples", type=int, default=20000)
    p.add_argument("--test-samples", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU (default: 64)")
    p.add_argument("--run-timeout", type=float, default=75.0, help="seconds per run (default: 75)")
    p.add_argument("--budget-s", type=float, default=240.0, help="seconds for everything (default: 240)")
    p.add_argument("--data-dir", default=None, help="synthetic MNIST goes here (default: OUT/data)")
    o = p.parse_args(argv)
    if o.cpu_smoke:
        o.widths, o.train_samples, o.test_samples, o.epochs = "1,2", 512, 128, 2
    bench = Bench(o)
    sys.path.insert(0, str(ROOT))
    from common.data import prepare_data
    prepare_data(bench.data_dir, "synthetic")  # written once here, read by every run
    print(f"[{bench.elapsed()}] data ready in {bench.data_dir}; {o.nproc} processes per run, budget {o.budget_s:.0f} s",
          flush=True)

    # 1. DDP and FSDP without the cap: speed, and the peaks that calibrate step 2 (FSDP's are step 3's baseline)
    widths = [int(w) for w in o.widths.split(",")]
    for w in widths:
        bench.run(f"calib-ddp-w{w}", "04", w)
        bench.run(f"calib-fsdp-w{w}", "05", w)

    # 2. where FSDP pays: DDP out of memory, FSDP trains, under the same cap
    cap_bytes = o.cap_gib * 2 ** 30
    width, why = bench.choose_width(cap_bytes)
    if o.cpu_smoke:
        width, why = widths[-1], "CPU smoke: no memory to measure; the DDP out-of-memory error is SIMULATED"
    bench.notes.append(f"step 2: cap {o.cap_gib} GiB per GPU; width {width}: {why}")
    short = (max(4 * o.batch_size * o.nproc, 512), 500)  # a few steps: the peak comes with the first optimizer step
    capped = ["--max-steps", "5"]
    for attempt in range(3):
        if width is None:
            break
        ddp = bench.run(f"capped-ddp-w{width}", "04", width, capped, o.cap_gib, fake_oom=o.cpu_smoke, samples=short)
        fsdp = bench.run(f"capped-fsdp-w{width}", "05", width, capped, o.cap_gib, samples=short)
        if ddp["status"] == "ok" and fsdp["status"] == "ok":  # DDP still fits: a larger model
            width = math.ceil(width * 1.15)
            bench.notes.append(f"DDP still fitted: trying width {width}")
        elif ddp["status"] == "out of memory" and fsdp["status"] != "ok":  # neither fits: a smaller one
            width = max(2, math.floor(width * 0.9))
            bench.notes.append(f"FSDP did not fit either: trying width {width}")
        else:
            break

    # 3. explicit prefetch, against the calib-fsdp runs of step 1; then bf16 under the cap, if time is left
    for w in widths:
        bench.run(f"prefetch-fsdp-w{w}", "05", w, ["--prefetch"])
    if width is not None:
        bench.run(f"capped-fsdp-amp-w{width}", "05", width, [*capped, "--amp"], o.cap_gib, samples=short)
    print(f"[{bench.elapsed()}] done: {bench.out / 'fsdp_gpu.md'}", flush=True)
    print((bench.out / "fsdp_gpu.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
