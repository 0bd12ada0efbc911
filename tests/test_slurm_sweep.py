"""The hyperparameter sweep as a Slurm job array (04_ddp_training/slurm_sweep_array.sh, table 04_ddp_training/sweep.tsv)
and the command that gathers it (slurm/gather_sweep.py).

On the two-node test cluster (2 CPUs per node) the array's 4 one-CPU tasks run at the same time, two on each node:
exactly the case where a port made from the array's job id alone would collide. The test waits for an empty queue
first, so that nothing else holds CPUs; then it checks each task's state, port, node, output folder and
configuration, that two tasks shared a node at the same time (Slurm's StartTime/EndTime), that the data was staged
once per node although two tasks wanted it at once (STAGE_DATA=1), and the gathered table and plot. As in the
other Slurm tests, only what a learner varies changes: sbatch --chdir and --cpus-per-task, the environment (site
variables), and trailing arguments for a tiny CPU run.
"""
import csv
import datetime
import json
import subprocess
import sys
import time

import pytest

from slurm.cluster import FINAL_STATES, parse_record
from slurm.jobs import ROOT, SOURCE_LINE, directives, fake_job_env, sbatch

SCRIPT = "04_ddp_training/slurm_sweep_array.sh"
TABLE = ROOT / "04_ddp_training/sweep.tsv"
GATHER = ROOT / "slurm/gather_sweep.py"
DEADLINE_S = 240  # an idle queue, then the 4 tasks (about 20 s when the machine is idle)


def table_rows(path=TABLE):
    lines = [l.split() for l in path.read_text().splitlines() if l.strip() and not l.lstrip().startswith("#")]
    return [dict(zip(lines[0], row)) for row in lines[1:]]


# ---- no cluster needed ------------------------------------------------------------------------------------
def test_sweep_script_and_table_agree():
    body = (ROOT / SCRIPT).read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / SCRIPT)]).returncode == 0
    d = directives(body)
    assert d["--array"] == f"0-{len(table_rows()) - 1}" and d["--output"] == "logs/%x-%A_%a.out"
    assert d["--ntasks-per-node"] == d["--gpus-per-node"] and d["--signal"] == "USR1@120" and "--requeue" in d
    assert f"\n{SOURCE_LINE}  # " in body and "\nstage_data  #" in body and "\nsweep_row " in body
    assert body.rstrip().endswith('python "$COURSE_DIR/trainer/train.py" --parallel ddp "${SWEEP_ARGS[@]}" '
                                  '--output-dir "$OUTPUT_DIR" --resume auto "$@"')  # the trainer: metrics.json
    assert [sorted(r) for r in table_rows()] == [["lr", "seed"]] * 4


def sweep_row(tmp_path, table, index):
    """slurm/job_env.sh's sweep_row in a stand-in array task: (exit status, SWEEP_ARGS or stderr)."""
    env = fake_job_env(tmp_path, SLURM_ARRAY_JOB_ID="700", SLURM_ARRAY_TASK_ID=str(index))
    probe = f'source "{ROOT}/slurm/job_env.sh" >/dev/null; sweep_row "{table}"; printf "%s\\n" "${{SWEEP_ARGS[@]}}"'
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", probe], capture_output=True, text=True, env=env)
    return done.returncode, done.stdout.split() if done.returncode == 0 else done.stderr


def test_sweep_row_reads_one_configuration(tmp_path):
    assert sweep_row(tmp_path, TABLE, 2) == (0, ["--lr", "0.5", "--seed", "1"])
    table = tmp_path / "t.tsv"
    table.write_text("# a comment\n\nlr  seed\tbatch-size\n0.1 1\t32\n  # another\n0.2 2\t64\n")
    assert sweep_row(tmp_path, table, 1) == (0, ["--lr", "0.2", "--seed", "2", "--batch-size", "64"])
    status, err = sweep_row(tmp_path, table, 2)
    assert status == 1 and f"error: array index 2 but {table} has 2 configuration(s): submit with --array=0-1" in err
    env = fake_job_env(tmp_path)  # not an array job
    done = subprocess.run(["bash", "-c", f'source "{ROOT}/slurm/job_env.sh" >/dev/null; sweep_row "{table}"'],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 1 and "error: not an array job: submit with sbatch --array=0-N" in done.stderr


def fake_run(folder, lr, seed, accuracies, batch_size=64):
    folder.mkdir(parents=True)
    epochs = [{"epoch": i + 1, "train_loss": 1.0 / (i + 1), "test_loss": 2.0 - a, "test_accuracy": a,
               "epoch_seconds": 1.5} for i, a in enumerate(accuracies)]
    args = {"lr": lr, "seed": seed, "batch_size": batch_size, "output_dir": str(folder), "data_dir": "/d"}
    (folder / "metrics.json").write_text(json.dumps({"args": args, "epochs": epochs}))


def test_gather_writes_one_table_and_one_plot(tmp_path):
    sweep = tmp_path / "sweep-9"
    fake_run(sweep / "task-0", 1.0, 2, [0.5, 0.7])
    fake_run(sweep / "task-1", 0.5, 1, [0.6, 0.65], batch_size=32)
    fake_run(sweep / "task-2", 0.5, 2, [0.4, 0.8])
    fake_run(sweep / "task-3", 1.0, 1, [])  # still before its first epoch: left out
    done = subprocess.run([sys.executable, str(GATHER), str(sweep)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    md = (sweep / "sweep.md").read_text().splitlines()
    assert md[0] == ("| run | lr | seed | batch_size | epochs | train_loss | test_loss | test_accuracy | "
                     "best_test_accuracy | train_seconds |") and len(md) == 2 + 3
    assert [row.split(" | ")[:4] for row in md[2:]] == [["| task-1", "0.5", "1", "32"], ["| task-2", "0.5", "2", "64"],
                                                        ["| task-0", "1", "2", "64"]]  # sorted by lr, then seed
    with open(sweep / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["run"], float(r["test_accuracy"]), float(r["best_test_accuracy"])) for r in rows] == \
        [("task-1", 0.65, 0.65), ("task-2", 0.8, 0.8), ("task-0", 0.7, 0.7)]
    assert (sweep / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = subprocess.run([sys.executable, str(GATHER), str(tmp_path / "nothing")], capture_output=True, text=True)
    assert empty.returncode == 1 and empty.stderr.startswith("error: ")


def test_a_port_in_use_is_address_already_in_use():
    """What slurm/README.md says happens when two tasks on one node use one MASTER_PORT: rank 0's store cannot listen."""
    import torch.distributed as dist
    first = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=5))
    with pytest.raises(RuntimeError, match="(?i)address already in use"):
        dist.TCPStore("127.0.0.1", first.port, 1, True, timeout=datetime.timedelta(seconds=5))


# ---- the real cluster --------------------------------------------------------------------------------------
def array_tasks(cluster, array_id):
    """`scontrol show job <array id>`: one record per task, by task index."""
    out = cluster.run("scontrol", "-o", "show", "job", str(array_id))
    records = [parse_record(line) for line in out.splitlines() if line.strip()]
    return {int(r["ArrayTaskId"]): r for r in records if r.get("ArrayTaskId", "").isdigit()}


def wait_until(ready, what, deadline, cluster):
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}\n{cluster.daemon_logs()}")
        time.sleep(0.2)


def seconds(stamp):
    return datetime.datetime.fromisoformat(stamp).timestamp()


def test_array_of_four_configurations(slurm_cluster, synthetic_dir, tmp_path):
    deadline = time.monotonic() + DEADLINE_S
    wait_until(lambda: not slurm_cluster.run("squeue", "-h").strip(), "an empty queue", deadline, slurm_cluster)
    (tmp_path / "logs").mkdir()
    local = slurm_cluster.node_local / "sweep"
    env = {"OUTPUT_ROOT": str(tmp_path / "runs"), "WORKSHOP_DATA_DIR": synthetic_dir, "STAGE_DATA": "1",
           "NODE_LOCAL_DIR": str(local)}
    args = ["--data", "synthetic", "--train-samples", 256, "--test-samples", 64, "--epochs", 1, "--num-workers", 0,
            "--device", "cpu"]
    array_id = sbatch(slurm_cluster, SCRIPT, args, 1, env, ROOT, tmp_path)
    rows = table_rows()

    def finished():
        tasks = array_tasks(slurm_cluster, array_id)
        return len(tasks) == len(rows) and all(t["JobState"] in FINAL_STATES for t in tasks.values())
    try:
        wait_until(finished, f"array job {array_id}", deadline, slurm_cluster)
    finally:
        subprocess.run(["scancel", str(array_id)], env=slurm_cluster.env, capture_output=True)
    tasks = array_tasks(slurm_cluster, array_id)
    logs = {i: (tmp_path / "logs" / f"sweep-{array_id}_{i}.out").read_text() for i in tasks}
    assert {i: t["JobState"] for i, t in tasks.items()} == {i: "COMPLETED" for i in range(len(rows))}, logs
    assert len({t["JobId"] for t in tasks.values()}) == len(rows)  # each task is a job of its own

    # each task: its configuration, its own folder, and its own port, from its own job id
    ports = {}
    for i, task in tasks.items():
        node, log = task["NodeList"], logs[i]
        port = 20000 + int(task["JobId"]) % 20000
        flags = f"--lr {rows[i]['lr']} --seed {rows[i]['seed']}"
        assert f"== array job {array_id} task {i} (of {len(rows)}) on {node}: {flags} | rendezvous {node}:{port} | " \
               f"output {tmp_path}/runs/sweep-{array_id}/task-{i}\n" in log, log
        ports[i] = port
        metrics = json.loads((tmp_path / "runs" / f"sweep-{array_id}" / f"task-{i}" / "metrics.json").read_text())
        assert (metrics["args"]["lr"], metrics["args"]["seed"]) == (float(rows[i]["lr"]), int(rows[i]["seed"]))
        assert metrics["lesson"] == "trainer-ddp"  # the production trainer writes the metrics gather_sweep reads
        assert [e["test_samples"] for e in metrics["epochs"]] == [64], metrics["epochs"]
    assert len(set(ports.values())) == len(rows)

    # two tasks on one node at the same time (Slurm's own record of when each ran)
    by_node = {}
    for i, task in tasks.items():
        by_node.setdefault(task["NodeList"], []).append(i)
    assert sorted(len(v) for v in by_node.values()) == [2, 2], by_node
    for node, (a, b) in by_node.items():
        start = {i: seconds(tasks[i]["StartTime"]) for i in (a, b)}
        end = {i: seconds(tasks[i]["EndTime"]) for i in (a, b)}
        assert start[a] < end[b] and start[b] < end[a], f"{node}: tasks {a}, {b} did not overlap: {start} {end}"
        assert ports[a] != ports[b]

        # staging: two tasks wanted the data on this node at the same time; one copied it, the other reused it
        staged = [l for l in (slurm_cluster.local_disk(node) / "sweep").glob("course-data-*.log")]
        assert len(staged) == 1, staged
        events = [line.split()[1:] for line in staged[0].read_text().splitlines()]
        assert sorted(e[-1] for e in events) == ["copied", "reused"] and {e[0] for e in events} == {node}, events
        assert {int(e[2]) for e in events} == {int(tasks[i]["JobId"]) for i in (a, b)}, events

    # one table of all runs, and one plot
    done = subprocess.run([sys.executable, str(GATHER), str(tmp_path / "runs" / f"sweep-{array_id}")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with open(tmp_path / "runs" / f"sweep-{array_id}" / "sweep.csv") as f:
        table = list(csv.DictReader(f))
    assert sorted((float(r["lr"]), int(r["seed"])) for r in table) == \
        sorted((float(r["lr"]), int(r["seed"])) for r in rows)
    assert len((tmp_path / "runs" / f"sweep-{array_id}" / "sweep.md").read_text().splitlines()) == 2 + len(rows)
    assert (tmp_path / "runs" / f"sweep-{array_id}" / "sweep.png").stat().st_size > 0
    print(f"\narray {array_id}: " + ", ".join(f"task {i} on {t['NodeList']} {t['StartTime']}..{t['EndTime']}"
                                             for i, t in sorted(tasks.items())))
