"""Launch detection: torchrun, Slurm (with its host-list syntax) and a single process."""
import pytest
import torch.distributed as dist

from common.distributed import LaunchEnv, detect_launch, launch_env, pick_device, slurm_master_port
from common.errors import CourseError
from common.hostlist import expand_hostlist


@pytest.mark.parametrize("nodelist, hosts", [
    ("n1", ["n1"]),
    ("n[1-2]", ["n1", "n2"]),
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("node[008-010]", ["node008", "node009", "node010"]),
    ("a[1-2]-ib,b3", ["a1-ib", "a2-ib", "b3"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
])
def test_expand_hostlist(nodelist, hosts):
    assert expand_hostlist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["gpu[01-03", "gpu[3-1]", "gpu[a-b]"])
def test_bad_hostlist_is_one_clear_error(bad):
    with pytest.raises(CourseError, match="Slurm host"):
        expand_hostlist(bad)


def test_torchrun_env():
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "node1", "MASTER_PORT": "29500", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    launch = detect_launch(env)  # torchrun inside a Slurm job: torchrun's variables win
    assert (launch.launcher, launch.rank, launch.local_rank, launch.world_size, launch.local_world_size) == \
        ("torchrun", 5, 1, 8, 4)
    assert (launch.master_addr, launch.master_port) == ("node1", 29500)


def test_slurm_env_one_task_per_gpu():
    env = {"SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "4(x2)",
           "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456"}
    launch = detect_launch(env)
    assert (launch.launcher, launch.rank, launch.local_rank, launch.world_size, launch.local_world_size) == \
        ("slurm", 6, 2, 8, 4)
    assert launch.master_addr == "gpu07"
    assert launch.master_port == slurm_master_port(123456) == 20000 + 123456 % 20000


def test_slurm_step_variables_win_over_job_ones():
    env = {"SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "2",
           "SLURM_STEP_TASKS_PER_NODE": "1,1", "SLURM_JOB_NODELIST": "gpu[01-04]",
           "SLURM_STEP_NODELIST": "gpu[03-04]", "SLURM_JOB_ID": "7", "MASTER_PORT": "30001"}
    launch = detect_launch(env)
    assert (launch.world_size, launch.local_world_size, launch.master_addr, launch.master_port) == \
        (2, 1, "gpu03", 30001)


def test_single_process():
    launch = detect_launch({})
    assert (launch.launcher, launch.rank, launch.world_size) == ("single", 0, 1)


@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
    ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "rank 2 is outside 0..1"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "not an integer"),
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, "rank 4 is outside 0..3"),
])
def test_inconsistent_env_is_one_clear_error(env, message):
    with pytest.raises(CourseError, match=message) as info:
        detect_launch(env)
    assert "\n" not in str(info.value)


def test_device_and_backend_on_cpu():
    assert pick_device("auto").type == "cpu"  # no GPU here
    assert dist.get_default_backend_for_device(pick_device("cpu")) == "gloo"
    assert dist.get_default_backend_for_device("cuda") == "nccl"
    with pytest.raises(CourseError, match="no CUDA GPU"):
        pick_device("cuda")


def fake_gpus(monkeypatch, count):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_more_local_ranks_than_gpus(monkeypatch):
    fake_gpus(monkeypatch, 2)
    assert str(pick_device("auto", LaunchEnv("torchrun", 1, 1, 2, 2))) == "cuda:1"
    with pytest.raises(CourseError, match="4 processes on this node but only 2 GPU"):
        pick_device("auto", LaunchEnv("torchrun", 3, 3, 4, 4))


def test_srun_task_bound_to_one_gpu_uses_it_whatever_its_local_rank(monkeypatch):
    # srun --ntasks-per-node=4 --gpus-per-task=1: each task sees only its own GPU, as cuda:0.
    fake_gpus(monkeypatch, 1)
    assert str(pick_device("auto", LaunchEnv("slurm", 7, 3, 8, 4))) == "cuda:0"
    # torchrun's processes all see the same GPUs: two of them on one GPU is a mistake, not a binding.
    with pytest.raises(CourseError, match="2 processes on this node but only 1 GPU"):
        pick_device("auto", LaunchEnv("torchrun", 1, 1, 2, 2))


def test_launch_env_exports_what_env_init_reads():
    env = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "2(x2)",
           "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "42"}
    launch_env(env)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                "MASTER_PORT")} == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                                    "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "n1",
                                                    "MASTER_PORT": str(slurm_master_port(42))}
