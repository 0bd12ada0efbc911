"""The benchmark runner: its CPU smoke mode end to end, its plan and budget, the page's targets from GPU-like rows.

`bench.py --quick` runs every suite for real on the CPU (gloo, synthetic digits, tiny sizes): the same launches,
lesson calls and row format as on GPUs, so a GPU run does not fail on a typo. Its numbers are no result, and the
page says so. The targets (met or missed: the ratios to the plain loop round by round, their median and spread; lesson
04's scaling against the peer's) are checked on hand-made rows, since no GPU is available here.
"""
import ast
import json
import pickle
import subprocess
import sys

from lessons import ROOT

sys.path.insert(0, str(ROOT))
from benchmarks import bench, memory, report, tables  # noqa: E402

SECTIONS = ("## Speed", "## Scaling", "## Time to 99%", "## FSDP2 memory", "## Tools", "## Tensor parallelism",
            "## Pipeline parallelism", "## Communication")
FAKE_REFERENCE = """import argparse
p = argparse.ArgumentParser()
p.add_argument("--seed", type=int)
p.add_argument("--epochs", type=int, default=14)
for epoch in range(p.parse_args().epochs):
    print(f"Test set: Average loss: 0.0{50 - epoch}, Accuracy: {9800 + epoch}/10000 (98%)")
"""


def test_quick_mode_runs_every_suite_and_writes_rows_page_and_plots(synthetic_dir, tmp_path):
    (tmp_path / "main.py").write_text(FAKE_REFERENCE)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "benchmarks/bench.py", "--quick", "--data-dir", synthetic_dir, "--out",
                           str(out), "--reference", str(tmp_path / "main.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(": ok,") == 8, proc.stdout  # 2 workers, lesson 06's, lesson 07's two, the capped one,
    # bandwidth, parity
    rows = json.loads((out / "benchmarks.json").read_text())["rows"]
    count = {s: sum(r["suite"] == s for r in rows) for s in bench.SUITES}
    assert count == {"throughput": 8, "peer": 2, "scaling": 3, "recipe": 2, "plain": 2, "dp": 1, "tools": 8,
                     "overlap": 4, "fsdp_oom": 2, "tp": 3, "pp": 10, "bandwidth": 1, "parity": 2}, count
    assert all(r["quick"] and r["data"] == "synthetic" and r["device_name"] == "CPU" for r in rows)
    for r in rows:  # what a row says about its epochs is what its epochs say
        if "epoch_seconds" in r and "accuracy" in r:
            assert {k: r[k] for k in ("time_to_99", "final_accuracy", "median_epoch_s")} == \
                tables.summary(r["epoch_seconds"], r["accuracy"])
    oom = {r["program"]: r for r in rows if r["suite"] == "fsdp_oom"}
    assert oom["05"]["status"] == "ok" and oom["05"]["s_per_step"] > 0
    assert oom["04"]["status"] == "out of memory" and "SIMULATED" in oom["04"]["error"]
    assert oom["04"]["error"].endswith("shard them with FSDP2 (lesson 05)")  # lesson 04's own one-line error
    reference = next(r for r in rows if r["suite"] == "parity" and r["program"] == "reference")
    assert reference["accuracy"] == [0.98] and reference["test_loss"] == [0.05]  # parsed from its output
    assert {r["variant"] for r in rows if r["suite"] == "overlap"} == {"default", "one", "small", "no_sync"}
    peer = sorted((r for r in rows if r["suite"] == "peer"), key=lambda r: r["gpus"])  # 256 images, batch 16: 8 steps
    assert [(r["gpus"], r["steps_per_epoch"], len(r["epoch_seconds"])) for r in peer] == [(1, 16, 1), (2, 8, 1)]
    assert all(r["images_per_second"] > 0 and 0 <= r["test_accuracy"] <= 1 for r in peer)
    pp = {r["variant"]: r for r in rows if r["suite"] == "pp"}  # lesson 07: 2 processes, and 2 over "sockets"
    assert sorted(pp) == sorted([f"{s} default" for s in ("ddp", "fsdp2", "tp", "pp")] + ["fsdp2 sockets", "pp sockets"]
                                + [f"{s} m4" for s in ("gpipe", "1f1b", "interleaved", "zb")])
    compare = [r for r in pp.values() if r["program"] == "compare"]
    assert len({(r["parameters"], r["batch"]) for r in compare}) == 1  # one model, one global batch, every strategy
    assert all(abs(r["images_per_s"] * r["s_per_step"] - r["batch"]) < 1e-6 and r["busbw"] > 0 for r in compare)
    assert {r["nccl_env"] for r in compare} == {"", "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1"}  # the launch's own env
    bubble = {r["schedule"]: r for r in pp.values() if r["program"] == "bubble"}
    assert all("error" not in r and len(r["timelines"]) == 2 and 0 <= r["idle_measured"] <= 1 for r in bubble.values())
    assert bubble["gpipe"]["held_microbatches"] == [4, 4] and bubble["1f1b"]["held_microbatches"] == [2, 1]

    page = (out / "benchmarks.md").read_text()
    assert page.startswith("# Benchmarks (CPU SMOKE MODE")
    assert all(section in page for section in SECTIONS) and "_Not measured" not in page
    measured = [line for line in page.splitlines() if line.startswith("_Measured on")]
    assert len(measured) == 18 and all("CPU smoke mode: not a result" in line for line in measured)
    pipeline = page.split("## Pipeline parallelism")[1].split("\n## ")[0]
    for head in ("| GPUs | schedule | micro-batches | s/step | idle measured (per rank) | idle predicted | peak MiB per "
                 "GPU | held micro-batches | status |", "| GPUs | NCCL | strategy | s/step | images/s | peak MiB per GPU "
                 "| wire MB/step | bus GB/s |", "| GPUs | strategy | wire MB/step | s/step default | s/step sockets | "
                 "sockets / default | bus GB/s default | bus GB/s sockets |"):
        assert head in pipeline
    assert len([line for line in pipeline.splitlines() if line.startswith("| 2 |")]) == 4 + 6 + 2 and \
        "| 2 | gpipe | 4 |" in pipeline and "| 2 | sockets | pp |" in pipeline and "| 2 | fsdp2 | 4.05 |" in pipeline
    peer_table = page.split("### Lesson 04 against a hand-written DDP loop")[1].split("\n### ")[0]
    assert "| GPUs | GPU | lesson 04 images/s | lesson 04 scaling | peer images/s | peer scaling | lesson 04 / peer " \
           "scaling | peer test accuracy | target |" in peer_table  # lesson 04 and the peer side by side, one run
    cells = [line.strip("| ").split(" | ") for line in peer_table.splitlines() if line[:4] in ("| 1 ", "| 2 ")]
    assert [c[0] for c in cells] == ["1", "2"] and cells[0][3] == cells[0][5] == "1.00x" and cells[0][-1] == "-"
    assert all(c[2] != "-" and c[4] != "-" for c in cells)  # lesson 04's row and the peer's, from the same run
    assert cells[1][6].endswith("x") and cells[1][-1] in ("**met**", "**missed**")
    step = page.split("### Lesson 04's step against the plain loop")[1].split("\n### ")[0].splitlines()
    assert "| ratio per round | median ratio | spread (min-max) | target |" in step[6]  # the step table's head
    step = [line for line in step if line.startswith(("| 1 | CPU |", "| 2 | CPU |"))]  # lesson 04 and plain paired
    assert len(step) == 2 and all(line.endswith("| too few rounds (1 of 3) |") for line in step), step
    ratio = next(line for line in page.splitlines() if line.startswith("| 2 | CPU | 16x0.01 | 1 | 1 |"))
    assert "| both missed 99% | - | - | no ratio" in ratio  # a tiny run's round: listed, not dropped
    for name in ("throughput", "time_to_99", "fsdp_memory", "bandwidth", "ddp_overlap", "pp_bubble_2"):
        assert (out / f"{name}.png").stat().st_size > 5000 and f"![{name}]({name}.png)" in page


def test_plan_fits_ten_minute_calls_and_runs_nothing(tmp_path, capsys):
    (tmp_path / "main.py").write_text(FAKE_REFERENCE)
    bench.main(["--plan", "--gpus", "1,2", "--reference", str(tmp_path / "main.py"), "--out", str(tmp_path / "o")])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in lines[:-1]] == ["worker-1:", "worker-2:", "tp-2:", "pp-2:", "pp-socket-2:",
                                                       "fsdp_oom-2:", "bandwidth-2:", "parity:"]
    # One 10-minute GPU call measures everything but lesson 07 (the docstring of benchmarks/bench.py), whose launches
    # on 2 and 4 GPUs and over sockets take at most 150 s: a call of their own, or the second call below
    seconds = {line.split()[2]: float(line.split()[0]) for line in lines[:-1]}
    assert sum(s for name, s in seconds.items() if not name.startswith("pp-")) <= 9.5 * 60
    assert not (tmp_path / "o").exists()
    bench.main(["--plan", "--gpus", "1,2,4"])  # more GPUs add a launch and rows; no --reference, no parity
    text = capsys.readouterr().out
    assert all(f"{name}-4:" in text for name in ("worker", "tp", "pp", "bandwidth")) and "parity skipped: no --reference" in text
    assert sum(float(line.split()[0]) for line in text.splitlines() if " pp-" in line) <= 150  # pp-2, pp-4, pp-socket-2
    assert "worker-4: recipe, plain, throughput, peer, scaling\n" in text  # every suite that runs on 4 GPUs
    # A 4-GPU host: every suite on 1, 2 and 4 GPUs in two 10-minute calls (merged with --report-only --merge)
    calls = ("recipe,plain,throughput,peer,scaling,dp,tools,overlap", "tp,pp,fsdp_oom,bandwidth,parity")
    assert sorted(",".join(calls).split(",")) == sorted(bench.SUITES)
    for suites in calls:
        bench.main(["--plan", "--gpus", "1,2,4", "--suite", suites, "--reference", str(tmp_path / "main.py")])
        lines = capsys.readouterr().out.splitlines()
        assert sum(float(line.split()[0]) for line in lines[:-1]) <= 9.5 * 60, lines


def test_the_peer_is_written_without_the_course():
    """benchmarks/peer_ddp.py is what a researcher writes by hand: torch, torchvision and the standard library only."""
    tree = ast.parse((ROOT / "benchmarks" / "peer_ddp.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
        {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert {name.split(".")[0] for name in imported} == {"__future__", "statistics", "time", "torch", "torchvision"}


def test_budget_skips_what_would_not_fit(synthetic_dir, tmp_path, capsys):
    bench.main(["--quick", "--suite", "bandwidth", "--budget", "1", "--data-dir", synthetic_dir, "--out", str(tmp_path)])
    assert "bandwidth-2 SKIPPED" in capsys.readouterr().out
    assert json.loads((tmp_path / "benchmarks.json").read_text()) == {"rows": []}
    assert "_Not measured in these rows._" in (tmp_path / "benchmarks.md").read_text()


def _row(suite, program, gpus, seed, t, final, epoch_s, device="NVIDIA H100 80GB HBM3", **kw):
    return {"suite": suite, "program": program, "gpus": gpus, "variant": "512x0.006", "seed": seed, "time_to_99": t,
            "final_accuracy": final, "median_epoch_s": epoch_s, "steps_per_epoch": 118, "device_name": device,
            "driver": "580", "torch": "2.11.0+cu130", "commit": "abc1234", "date": "2026-11-27", "data": "mnist",
            "quick": False, **kw}


def test_round_by_round_ratios_and_the_peers_scaling_from_gpu_like_rows(tmp_path):
    rows = []
    # 1 GPU: times to 99% 1.05x, 1.30x, 1.02x, 1.08x, 1.00x: median 1.05x, 99.2%: met; the step 1.20x: missed.
    # 2 GPUs: a round where the plain loop missed 99%, one where lesson 04 did; median 1.05x, but 99.0%: missed.
    for seed, t1, t2, p2, s2 in zip((1, 2, 3, 4, 5), (1.05, 1.30, 1.02, 1.08, 1.0), (0.63, 0.63, 0.63, 0.63, None),
                                    (0.6, 0.6, 0.6, None, 0.6), (0.20, 0.21, 0.19, 0.20, 0.25)):
        rows += [_row("recipe", "04", 1, seed, t1, 0.992, 0.30), _row("plain", "plain", 1, seed, 1.0, 0.99, 0.25),
                 _row("recipe", "04", 2, seed, t2, 0.990, s2), _row("plain", "plain", 2, seed, p2, 0.99, 0.19)]
    rows.append(_row("recipe", "04", 4, 1, None, 0.988, 0.1))  # no plain loop on 4 GPUs in this run: no ratio
    rows.append(_row("plain", "plain", 4, 1, 0.5, 0.99, 0.1, device="NVIDIA H200"))  # another machine: not paired
    rows += [_row(suite, program, 8, seed, 0.5, 0.992, 0.1) for seed in (1, 2)
             for suite, program in (("recipe", "04"), ("plain", "plain"))]  # 8 GPUs: two rounds, too few
    for n, lesson, peer in ((1, 17000, 15000), (2, 30000, 27000), (4, 50000, 50000)):  # 0.98x: met; 0.88x: missed
        rows += [_row("throughput", "04", n, None, None, None, 3.5, variant="dataloader", batch=64,
                      images_per_second=lesson),
                 _row("peer", "peer", n, None, None, None, 3.5, variant="dataloader", images_per_second=peer,
                      test_accuracy=0.99)]
    rows.append(_row("peer", "peer", 2, None, None, None, 2.0, device="NVIDIA H200", variant="dataloader",
                     images_per_second=27000, test_accuracy=0.99))  # no lesson 04 row of that run
    report.write(tmp_path, rows)
    page = (tmp_path / "benchmarks.md").read_text()
    assert "| 1 | NVIDIA H100 80GB HBM3 | 512x0.006 | 5 | 5 | 1.05 s | 1.00 s | 1.05x | 99.20% | 1.05x, 1.30x, " \
           "1.02x, 1.08x, 1.00x | 1.05x | 1.00x to 1.30x | **met** |" in page
    assert "| 0.63 s | 0.60 s | 1.05x | 99.00% | 1.05x, 1.05x, 1.05x, plain missed 99%, 04 missed 99% | 1.05x | " \
           "plain missed 99% to 04 missed 99% | **missed** |" in page
    assert "| 4 | NVIDIA H100 80GB HBM3 | 512x0.006 | 1 | 0 | - | - | - | 98.80% | - | - | - | not measured" in page
    assert "| 0.50 s | 0.50 s | 1.00x | 99.20% | 1.00x, 1.00x | 1.00x | 1.00x to 1.00x | too few rounds (2 of 3) |" \
        in page
    assert "| 1 | NVIDIA H100 80GB HBM3 | 512x0.006 | 5 | 0.300 | 2.54 | 0.250 | 2.12 | 1.20x, 1.20x, 1.20x, 1.20x, " \
           "1.20x | 1.20x | 1.20x to 1.20x | **missed** |" in page  # the step, round by round
    assert "| 0.200 | 1.69 | 0.190 | 1.61 | 1.05x, 1.11x, 1.00x, 1.05x, 1.32x | 1.05x | 1.00x to 1.32x | **met** |" \
        in page
    assert "| 1 | NVIDIA H100 80GB HBM3 | 17,000 | 1.00x | 15,000 | 1.00x | 1.00x | 99.00% | - |" in page
    assert "| 2 | NVIDIA H100 80GB HBM3 | 30,000 | 1.76x | 27,000 | 1.80x | 0.98x | 99.00% | **met** |" in page
    assert "| 4 | NVIDIA H100 80GB HBM3 | 50,000 | 2.94x | 50,000 | 3.33x | 0.88x | 99.00% | **missed** |" in page
    assert "| 2 | NVIDIA H200 | - | - | 27,000 | - | - | 99.00% | not measured (no lesson 04 scaling in this run) |" in page
    assert "Rows of different runs: compare with care" in page  # the per-seed table holds the H200 row too


def test_overlap_reads_kernels_and_backward_from_a_cuda_trace(tmp_path):
    """The format torch.profiler writes with CUDA: kernels (cat "kernel") linked to their CPU launches by correlation."""
    from benchmarks import overlap

    def x(cat, name, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 1, "args": args}

    events = [x("user_annotation", "step", 1000, 500), x("user_annotation", "forward 0", 1000, 100),
              x("user_annotation", "backward 0", 1100, 300),
              x("kernel", "ncclDevKernel_AllReduce_Sum_f32 (the barrier, before the step)", 900, 50),
              x("cuda_runtime", "cudaLaunchKernel", 1010, 5, correlation=1),  # forward
              x("kernel", "sm90_xmma_fprop", 1050, 100, correlation=1),
              x("cuda_runtime", "cudaLaunchKernel", 1120, 5, correlation=2),  # backward
              x("kernel", "wgrad_kernel", 1200, 200, correlation=2),
              x("cuda_driver", "cuLaunchKernelEx", 1150, 5, correlation=3),  # DDP's bucket all_reduce
              x("kernel", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 1300, 150, correlation=3)]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    info = overlap.lanes(str(tmp_path / "trace.json"))
    assert info["lanes"] == {"compute kernels": [(0.05, 0.15), (0.2, 0.4)], "NCCL kernels": [(0.3, 0.45)]}
    assert info["backward"] == [(0.2, 0.4)]  # the GPU span of the kernels backward() launched
    n = overlap.numbers(info)
    assert n["comm_kernels"] == 1 and abs(n["comm_ms"] - 0.15) < 1e-9
    assert abs(n["overlapped_ms"] - 0.1) < 1e-9 and abs(n["exposed_ms"] - 0.05) < 1e-9


def test_the_pages_memory_snapshots_replay_to_the_peak_the_lesson_measured(tmp_path):
    """docs/memory_05.pickle and memory_04.pickle are the fsdp_oom suite's GPU snapshots (rank 0). Replayed by
    category, lesson 05's run peaks where lesson 05's own max_memory_allocated did, and lesson 04's ends in its OOM
    with AdamW's state as the last thing it tried to hold."""
    runs = {r["program"]: r for r in report.load(ROOT / "docs" / "benchmarks.json") if r["suite"] == "fsdp_oom"}
    peaks = memory.draw(ROOT / "docs" / "memory_05.pickle", tmp_path / "05.png", "lesson 05", cap_gib=6.0)
    assert abs(peaks["total"] - runs["05"]["peak_bytes"]) <= 0.002 * runs["05"]["peak_bytes"], peaks
    assert {"parameters", "optimizer state", "gradients", "gathered units", "activations"} <= set(peaks)
    assert (tmp_path / "05.png").stat().st_size > 5000
    with open(ROOT / "docs" / "memory_04.pickle", "rb") as f:
        snapshot = pickle.load(f)
    seconds, bands, ooms = memory.timeline(snapshot)
    assert runs["04"]["status"] == "out of memory" and len(ooms) == 1
    last_alloc = next(e for e in reversed(snapshot["device_traces"][0]) if e["action"] == "alloc" and e["time_us"]
                      <= snapshot["device_traces"][0][0]["time_us"] + ooms[0] * 1e6)
    assert memory.categorize(last_alloc) == "optimizer state"


def test_a_copy_inside_another_repository_names_no_commit(tmp_path):
    """The course from `git archive`, unpacked inside another git repository (a tarball on a cluster): the rows say
    "unknown", not the other repository's commit; --commit names one; the course's own repository names its HEAD."""
    outer, course = tmp_path / "outer", tmp_path / "outer" / "course"
    course.mkdir(parents=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q", str(outer)], check=True)
    subprocess.run([*git, "-C", str(outer), "commit", "-q", "--allow-empty", "-m", "outer"], check=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(course)], input=archive, check=True)
    (course / "benchmarks" / "bench.py").write_text((ROOT / "benchmarks" / "bench.py").read_text())  # the code tested
    outer_head = subprocess.run(["git", "-C", str(outer), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    probe = ("import argparse, sys; sys.path.insert(0, '.'); from benchmarks import bench; "
             "print(bench.machine(argparse.Namespace(commit=sys.argv[1] or None, quick=True, data='synthetic'))"
             "['commit'])")
    said = {where: {commit: subprocess.run([sys.executable, "-c", probe, commit], cwd=where, capture_output=True,
                                           text=True, timeout=120).stdout.strip() for commit in ("", "abc1234")}
            for where in (course, ROOT)}
    assert said[course] == {"": "unknown", "abc1234": "abc1234"} and outer_head not in said[course][""]
    own = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert said[ROOT][""].split("+")[0] == own and said[ROOT]["abc1234"] == "abc1234"
