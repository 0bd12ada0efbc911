"""The runner's llm suites (lesson 08's model class): the CPU smoke mode end to end, the plan of the GPU calls, the
trace's classes, an out-of-memory error caught per run, and the page's section from GPU-like rows.

`bench.py --quick --suite llm` runs every llm suite for real on the CPU (gloo, a 32x narrower 2-layer Llama, a few
steps); what needs a GPU (the matmul sweep, the traces, float8, the capped runs) is skipped with one line each.
"""
import json
import subprocess
import sys

import pytest
import torch

from lessons import ROOT

sys.path.insert(0, str(ROOT))
from benchmarks import bench, llm, llm_fit, llm_suites, llm_tables, llm_trace, report  # noqa: E402

H100 = "NVIDIA H100 80GB HBM3"
H100_BYTES = 81559 * 2**20  # torch.cuda.mem_get_info's total on the 4x H100 host (KINDS.md)


def test_quick_mode_runs_every_llm_suite_and_writes_its_section(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "benchmarks/bench.py", "--quick", "--suite", "llm", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for launch in ("llm-1 (llm_speed)", "llm-2 (llm_trace, llm_speed, llm_fp8)", "llm_fit-1 (llm_fit)"):
        assert f"{launch}: ok" in proc.stdout, proc.stdout
    log = (out / "bench.log").read_text()
    for line in ("llm_speed: matmul sweep skipped (no GPU)", "llm_fit: capped runs skipped (no GPU)",
                 "llm_trace: traces skipped (no GPU kernels on the CPU)",
                 "llm_fp8: skipped: float8 training needs an H100 or H200, not CPU"):
        assert log.count(line) == (2 if "sweep" in line else 1), line
    assert "Warning" not in log
    rows = json.loads((out / "benchmarks.json").read_text())["rows"]
    count = {s: sum(r["suite"] == s for r in rows) for s in bench.LLM}
    assert count == {"llm_speed": 8, "llm_trace": 6, "llm_fp8": 1, "llm_fit": 4}, count
    trained = [r for r in rows if r.get("outcome") == "trained"]
    assert len(trained) == 18 and all(r["quick"] and r["device_name"] == "CPU" for r in rows)
    assert {r["allocator"] for r in trained if r["suite"] == "llm_fit"} == {"default"}  # the estimate's allocator
    assert {r["allocator"] for r in trained if r["suite"] != "llm_fit"} == {"expandable_segments:True"}
    for r in trained:
        assert abs(r["tokens_per_s"] * r["step_s"] - r["batch"] * r["seq"]) < 1e-6 * r["batch"] * r["seq"]
        assert len(r["losses"]) == r["warmup"] + r["steps"] == 3 and r["seq"] == llm.QUICK_SEQ
        cfg = llm.config(r["shape"], True)  # 6 N + 12 L a s, N without the input embedding, a = heads x head_dim
        n, width = r["parameters"] - cfg.vocab_size * cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
        assert r["flops_per_token"] == 6 * n + 12 * cfg.num_hidden_layers * width * r["seq"]
        assert r["mfu"] is None  # no peak for a CPU
    speed = {(r["gpus"], r["program"], r["variant"]): r for r in rows if r["suite"] == "llm_speed"}
    for (gpus, shape, variant), r in speed.items():  # one model, one data: compiled or not, the same first loss
        assert r["compile"] == r["loss_compile"] == (variant == "compile") and not r["reshard_last"] and r["fused"]
        assert abs(r["losses"][0] - speed[gpus, shape, "eager"]["losses"][0]) < 1e-3
        assert r["estimate"] > 0 and r["fits_line"] > r["tight_line"] > r["estimate"]
    chain = sorted((r for r in rows if r["suite"] == "llm_trace"), key=lambda r: r["order"])
    fields = ("batch", "compile", "reshard_last", "loss_compile", "fused")
    assert [r["change"] for r in chain][1:] == ["compile", "batch", "reshard_after_forward=False on the last layer",
                                               "compiled loss", "fused AdamW"]
    for before, after in zip(chain, chain[1:]):  # each row changes one setting, and keeps the others
        assert sum(before[f] != after[f] for f in fields) == 1
    assert (chain[0]["batch"], chain[0]["fused"], chain[-1]["fused"]) == (1, False, True)
    fit = {r["variant"]: r for r in rows if r["suite"] == "llm_fit"}
    assert sorted(fit) == ["ddp uncapped", "fsdp2 uncapped", "fsdp2-ac uncapped"] and \
        {r["program"] for r in fit.values()} == {"1.1B", "152k"}
    page = (out / "benchmarks.md").read_text()
    section = page.split("## Lesson 08's model class")[1]
    for title in ("Tokens/s and MFU", "The matmul ceiling", "What limits the step", "Where the step's time goes",
                  "float8 training (torchao)", "float8's loss against bf16's", "Will it fit, at the margin"):
        assert f"### {title}" in section
    assert "| 2 | h4096 | per layer + loss | 2 |" in section and "| 2 | 5 | fused AdamW | 2 |" in section


def test_the_plan_puts_every_llm_suite_in_two_calls_of_nine_minutes(capsys):
    # Each call: two bench.py runs, one after the other, into one --out (benchmarks/llm_suites.py's docstring)
    calls = ((["--gpus", "2", "--suite", "llm_trace,llm_speed"], ["--gpus", "1", "--suite", "llm_speed"]),
             (["--gpus", "1", "--suite", "llm_fit"], ["--gpus", "4", "--suite", "llm_speed,llm_fp8"]))
    for call in calls:
        seconds = 0.0
        for argv in call:
            bench.main(["--plan"] + argv)
            lines = capsys.readouterr().out.splitlines()
            seconds += sum(float(line.split()[0]) for line in lines[:-1])
        assert seconds <= 9 * 60, (call, seconds)
    bench.main(["--plan", "--gpus", "1,2,4", "--suite", "llm"])  # llm: all four, each where it belongs
    text = capsys.readouterr().out
    assert "llm-1: llm_speed\n" in text and "llm-2: llm_trace, llm_speed, llm_fp8\n" in text
    assert "llm-4: llm_speed, llm_fp8\n" in text and "llm_fit-1: llm_fit\n" in text and "worker" not in text
    with pytest.raises(SystemExit):
        bench.main(["--plan", "--suite", "llm_nothing"])
    assert "unknown suite(s) llm_nothing" in capsys.readouterr().err


def test_the_fill_batch_is_the_largest_the_estimate_fits():
    for shape, gpus in (("1.1B", 1), ("h4096", 2), ("h4096", 4)):
        b = llm_fit.fill_batch(shape, gpus, H100_BYTES, quick=False)
        assert llm_fit.lines(shape, False, "fsdp2", gpus, b)["fits_line"] <= H100_BYTES
        assert llm_fit.lines(shape, False, "fsdp2", gpus, b + 1)["fits_line"] > H100_BYTES
    est = {"fits_line": 10, "tight_line": 8}
    assert [llm_fit.verdict(est, m) for m in (10, 9, 7)] == ["fits", "tight", "does not fit"]


def test_kernels_are_classified_and_exposed_communication_is_what_no_compute_covers(tmp_path):
    def k(name, ts, dur, stream):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}
    events = [k("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", 0, 400, 7),
              k("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", 400, 200, 7),
              k("triton_red_fused__log_softmax_nll_loss_forward_0", 600, 100, 7),
              k("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>, FusedAdamMathFunctor>",
                700, 100, 7),
              k("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_1", 800, 100, 7),
              k("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 300, 300, 20),  # under compute
              k("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 1000, 200, 20),  # exposed: nothing runs with it
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000}]
    assert llm_trace.classify("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128") == "matmul"
    assert llm_trace.classify("void at::native::multi_tensor_apply_kernel<TensorListMetadata<2>, CopyFunctor>") == \
        "other"  # FSDP2's foreach copies, not the optimizer
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    s = llm_trace.shares(str(tmp_path / "t.json"), steps=2)
    assert [s[f"{c}_ms"] for c in ("matmul", "attention", "loss", "optimizer", "other")] == \
        pytest.approx([0.2, 0.1, 0.05, 0.05, 0.05])
    assert (s["communication_ms"], s["exposed_communication_ms"]) == pytest.approx((0.25, 0.1))
    assert (s["step_ms"], s["idle_ms"], s["kernels"]) == pytest.approx((0.6, 0.05, 7))
    assert llm_trace.busiest(str(tmp_path / "t.json"), 1) == [[events[0]["name"], "matmul", 0.4]]


def test_an_out_of_memory_run_is_a_row_and_the_next_run_trains_and_a_late_run_is_skipped(monkeypatch, capsys):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from types import SimpleNamespace
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        L = SimpleNamespace(device=torch.device("cpu"), quick=True, rank=0, world=1, gpu="CPU")
        mesh, setup = init_device_mesh("cpu", (1,)), llm.Setup("1.1B", 1, warmup=1, steps=1)

        def oom(*args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.64 GiB (simulated)")
        with monkeypatch.context() as m:
            m.setattr(torch.optim.AdamW, "step", oom)
            row = llm.train(setup, L, mesh)
        assert row["outcome"] == "out of memory" and row["error"].endswith("4.64 GiB (simulated)")
        assert "tokens_per_s" not in row and "mfu" not in row
        assert llm.train(setup, L, mesh)["outcome"] == "trained"
        L.spec = {"deadline_s": 3600.0}
        assert not llm_suites.late(L, "llm_speed 1.1B eager") and capsys.readouterr().out == ""
        L.spec = {"deadline_s": 0.0}  # every rank agrees (an all_reduce), and rank 0 says so
        assert llm_suites.late(L, "llm_speed 1.1B eager")
        assert capsys.readouterr().out == "llm: llm_speed 1.1B eager skipped: past the launch's deadline (0 s)\n"
    finally:
        dist.destroy_process_group()


def test_float8_is_skipped_with_one_line_without_an_h100_or_torchao(monkeypatch, capsys):
    rows = []
    L = SimpleLaunch(torch.device("cpu"), "CPU", rows)
    llm_suites.fp8(L)
    assert capsys.readouterr().out == "llm_fp8: skipped: float8 training needs an H100 or H200, not CPU\n"
    assert rows == [("llm_fp8", {"program": "-", "variant": "skipped", "outcome": "skipped",
                                 "error": "float8 training needs an H100 or H200, not CPU"})]
    monkeypatch.setattr(llm_suites.importlib.util, "find_spec", lambda name: None)
    assert "torchao is not installed" in llm_suites.fp8_missing(SimpleLaunch(torch.device("cuda", 0), H100, rows))
    lm_head, layer = torch.nn.Linear(64, 100), torch.nn.Linear(64, 128)
    assert not llm.float8_filter(lm_head, "lm_head") and llm.float8_filter(layer, "model.layers.0.mlp.up_proj")
    assert not llm.float8_filter(torch.nn.Linear(64, 100), "model.layers.0.mlp.up_proj")  # 100: not a multiple of 16


class SimpleLaunch:
    def __init__(self, device, gpu, rows):
        self.device, self.gpu, self.rows, self.rank, self.world, self.quick = device, gpu, rows, 0, 1, False

    def emit(self, suite, **row):
        self.rows.append((suite, row))


def _gpu_rows():
    stamp = {"device_name": H100, "driver": "580.159.04", "torch": "2.11.0+cu130", "commit": "abc1234",
             "date": "2026-11-28", "data": "mnist", "quick": False}
    peak = 989.4e12

    def run(suite, program, gpus, variant, **kw):
        return {**stamp, "suite": suite, "program": program, "gpus": gpus, "variant": variant, **kw}
    speed = lambda shape, gpus, compiled, mfu: run(  # noqa: E731
        "llm_speed", shape, gpus, "compile" if compiled else "eager", compile=compiled, batch=8, outcome="trained",
        tokens_per_s=mfu * peak / 1e10, mfu=mfu, peak_flops=peak, step_s=0.3, warmup_s=40, estimate=40 * 2**30,
        peak_allocated=42 * 2**30, peak_reserved=50 * 2**30)
    rows = [run("llm_speed", "matmul", 2, "8192^3", n=8192, tflops=791.5), speed("h4096", 2, True, 0.57),
            speed("h4096", 2, False, 0.48), speed("h4096", 1, True, 0.52), speed("1.1B", 2, True, 0.42)]
    rows += [run("llm_trace", "h4096", 2, f"{i} {c}", order=i, change=c, batch=b, outcome="trained",
                 tokens_per_s=t, mfu=t / 1e5, **({"shares": {"step_ms": 100.0, **{f"{k}_ms": 10.0 for k in (
                     "matmul", "attention", "loss", "optimizer", "other", "communication", "exposed_communication",
                     "idle")}}, "busiest": [["nvjet_tst", "matmul", 12.5]]} if i == 1 else {}))
             for i, (c, b, t) in enumerate((("none", 2, 30000.0), ("compile", 2, 36000.0)))]
    rows += [run("llm_fp8", "h4096", 2, "rowwise", float8="rowwise", batch=8, steps=10, outcome="trained",
                 tokens_per_s=0.57 * peak / 1e10 * 1.25, mfu=0.71),
             run("llm_fp8", "h4096", 2, "loss bf16", steps=200, outcome="trained", losses=[10.0] * 180 + [2.0] * 20),
             run("llm_fp8", "h4096", 2, "loss rowwise", steps=200, outcome="trained", float8="rowwise",
                 losses=[10.0] * 180 + [2.02] * 20)]
    fit = {"program": "1.1B", "strategy": "fsdp2", "batch": 4, "estimate": 30 * 2**30, "fits_line": 34 * 2**30,
           "tight_line": 32 * 2**30, "context": 1.6 * 2**30}
    rows += [run("llm_fit", gpus=1, variant="fsdp2 uncapped", outcome="trained", peak_allocated=30.1 * 2**30,
                 peak_reserved=34 * 2**30, **fit),
             run("llm_fit", gpus=1, variant="fsdp2 capped at 100% of fits", cap_bytes=32.4 * 2**30, verdict="fits",
                 outcome="trained", **fit),
             run("llm_fit", gpus=1, variant="fsdp2 capped at 90% of tight", cap_bytes=27.2 * 2**30,
                 verdict="does not fit", outcome="out of memory", error="CUDA out of memory. Tried to allocate 2 GiB",
                 **fit)]
    return rows


def test_the_section_from_gpu_like_rows_says_targets_ratios_and_agreement():
    rows = _gpu_rows()
    lines = llm_tables.section(rows)
    text = "\n".join(lines)
    assert "_Measured on NVIDIA H100 80GB HBM3, driver 580.159.04, torch 2.11.0+cu130, course commit abc1234" in text
    assert "| 2 | h4096 | per layer + loss | 8 | 56,396 | 57.0% | 71.3% |" in text  # 0.57 x 989.4 / 791.5
    assert text.count("**met** (55%)") == 1 and "| 1 | h4096 | per layer + loss | 8 | 51,449 | 52.0% | - |" in text
    assert "**missed** (43%)" in text and "| 2 | h4096 | eager | 8 | 47,491 | 48.0% | 60.0% |" in text
    assert "| 2 | 8192 | 792 | 80.0% |" in text
    assert "| 2 | 1 | compile | 2 | 36,000 | 36.0% | 1.20x |" in text
    assert "| 2 | compile | 100.0 | 10.0 (10%) |" in text and "`nvjet_tst` (matmul, 12.5 ms)" in text
    assert "| 2 | h4096 | rowwise | 8 | 70,495 | 1.25x | 71.0% |" in text
    assert "| 2 | rowwise | 10.000 | 10.000 | 10.000 | 2.020 | 2.020 | +1.00% |" in text
    fit = [line for line in lines if line.startswith("| 1 | 1.1B | fsdp2 |")]
    assert [line.rsplit("|", 3)[1:3] for line in fit] == [[" trained ", " - "], [" trained ", " yes "],
                                                          [" out of memory ", " yes "]]  # uncapped, then capped
    assert "| 30.0 | 34.0 | 32.0 | - | - | 30.1 | 34.0 | 1.130 | 1.003 | 1.6 |" in fit[0]
    assert "- 1 GPU(s), fsdp2 capped at 90% of tight: `CUDA out of memory. Tried to allocate 2 GiB`" in text
    assert report.key(rows[-1]) != report.key(rows[-2])  # every capped run its own row
    rows[-2]["outcome"], rows[-1]["outcome"] = "out of memory", "trained"  # each capped run did what the other must
    fit = [line for line in llm_tables.section(rows) if line.startswith("| 1 | 1.1B | fsdp2 |")]
    assert [line.rsplit("|", 3)[1:3] for line in fit[1:]] == [[" out of memory ", " **no** "],
                                                              [" trained ", " **no** "]]  # whatever the verdict says
    assert llm_tables.section([r for r in rows if r["suite"] == "tp"]) == []  # no llm rows: no section
