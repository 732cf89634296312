"""Process launch: local workers via torchrun's machinery, failures end the job, two torchrun agents on loopback."""

import os
import socket
import subprocess
import sys

import pytest

from support.launch_workers import ALL_REDUCE_SCRIPT, all_reduce_ranks, fail_on_rank_one
from mindformers_py.errors import ConfigError
from mindformers_py.launcher.launch import (
    LaunchError,
    check_world_size,
    distributed_env,
    launch,
    multinode_command,
    needs_launch,
)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_distributed_env_reads_torchrun_variables():
    assert distributed_env({}) is None
    env = distributed_env({"LOCAL_RANK": "1", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)


def test_launch_decision_and_world_size_check(monkeypatch):
    for key in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)
    assert needs_launch(2) and not needs_launch(1)
    assert check_world_size(4) == 4
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not needs_launch(2)  # under torchrun: use the given world
    assert check_world_size(2) == 2
    with pytest.raises(ConfigError, match="world_size=4.*WORLD_SIZE=2"):
        check_world_size(4)


def test_multinode_command_is_a_torchrun_rendezvous():
    cmd = multinode_command(2, 8, "10.0.0.1:29400", ["run", "tasks/gpt/pretrain_tiny.yaml", "--parallel_mode",
                                                     "semi_auto_parallel"])
    assert cmd.startswith("torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint 10.0.0.1:29400")
    assert cmd.endswith("-m mindformers_py run tasks/gpt/pretrain_tiny.yaml --parallel_mode semi_auto_parallel")


def test_launch_rejects_bad_arguments():
    with pytest.raises(ConfigError, match="nproc=0"):
        launch(["-c", "pass"], 0)
    with pytest.raises(ConfigError, match="rdzv_endpoint"):
        launch(["-c", "pass"], 1, nnodes=2)


def test_function_workers_form_one_world():
    results = launch(all_reduce_ranks, 2, 10)
    assert results == {0: (0, 2, 30), 1: (1, 2, 30)}


def test_command_line_workers_form_one_world(tmp_path, capfd):
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE_SCRIPT)
    launch([str(script)], 2)
    out = capfd.readouterr().out
    assert "rank=0 world=2 local_world=2 sum=3" in out and "rank=1 world=2 local_world=2 sum=3" in out


def test_a_failing_command_line_worker_ends_the_job_with_its_exit_code():
    with pytest.raises(LaunchError) as err:
        launch(["-c", "import os, sys; sys.exit(3 if os.environ['RANK'] == '1' else 0)"], 2)
    assert str(err.value) == "rank 1 of the job failed with exit code 3; the other ranks were stopped"


@pytest.mark.parametrize("how, expected", [("kill", "exit code -9 (SIGKILL)"), ("raise", "RuntimeError: rank one gave up")])
def test_a_failed_rank_ends_the_whole_job_with_an_error(how, expected):
    with pytest.raises(LaunchError, match="rank 1") as err:
        launch(fail_on_rank_one, 2, how)
    assert expected in str(err.value) and "other ranks were stopped" in str(err.value)


def test_two_torchrun_agents_on_loopback(tmp_path):
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE_SCRIPT)
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "loopback",
           "--local_addr", "127.0.0.1", str(script)]
    agents = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outputs = []
    try:
        for agent in agents:
            out, _ = agent.communicate(timeout=240)
            outputs.append(out)
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    joined = "\n".join(outputs)
    assert "rank=0 world=2 local_world=1 sum=3" in joined and "rank=1 world=2 local_world=1 sum=3" in joined


def test_the_failure_named_is_the_cause_not_the_ranks_the_agent_stopped():
    """A rank SIGKILLed after its peer (by the timestamps) is still the cause when the peer ended on the agent's
    SIGTERM; among exceptions the earliest is named."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from mindformers_py.launcher.launch import _failure_summary

    def failure(rank, exitcode, timestamp):
        out = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file="/nonexistent")
        out.timestamp = timestamp
        return out

    stopped_first = {0: failure(0, -15, 1.0), 1: failure(1, -9, 2.0)}
    assert _failure_summary(ChildFailedError("w", stopped_first)).startswith("rank 1 of the job failed with exit code -9 (SIGKILL)")
    alone = {1: failure(1, -15, 1.0)}
    assert _failure_summary(ChildFailedError("w", alone)) == "rank 1 of the job failed with exit code -15 (SIGTERM)"
    raised = {0: failure(0, 1, 2.0), 1: failure(1, 1, 1.0)}
    assert _failure_summary(ChildFailedError("w", raised)) == "rank 1 of the job failed with exit code 1 (1 more rank(s) failed)"
    # issue 37: rank 2 raised, the agent stopped the others (SIGTERM, some seen earlier): rank 2 is the cause
    stopped_after_raise = {0: failure(0, -15, 1.0), 1: failure(1, -15, 1.0), 2: failure(2, 1, 2.0), 3: failure(3, -15, 1.0)}
    assert _failure_summary(ChildFailedError("w", stopped_after_raise)) == \
        "rank 2 of the job failed with exit code 1 (3 more rank(s) failed)"


# Rank 1 of a CLI job raises (as the MoE pipeline did under bf16) while rank 0 waits, as in a collective, until the
# launcher stops it.
_CLI_RANK_ONE_RAISES = """
import os, sys, time
from mindformers_py import cli

def show(args):
    if os.environ["RANK"] == "1":
        raise RuntimeError("index_add_(): self (BFloat16) and source (Float) must have the same scalar type")
    time.sleep(120)

cli._cmd_show = show
sys.exit(cli.main(["show"]))
"""


def test_the_jobs_last_line_names_the_first_failing_rank_and_its_error(tmp_path):
    script = tmp_path / "rank_one_raises.py"
    script.write_text(_CLI_RANK_ONE_RAISES)
    with pytest.raises(LaunchError) as err:
        launch([str(script)], 2)
    assert str(err.value) == ("rank 1 of the job failed with exit code 1: RuntimeError: index_add_(): self (BFloat16) "
                              "and source (Float) must have the same scalar type (1 more rank(s) failed); the other "
                              "ranks were stopped")
    assert err.value.rank == 1 and err.value.exitcode == 1


def test_a_cli_rank_whose_peer_died_says_so_in_one_line(monkeypatch, capsys):
    """Under a launcher, a rank whose collective fails because another rank died prints one line (the launcher names
    the rank that died), not a traceback; any other exception keeps its traceback."""
    import torch.distributed  # noqa: F401 - a worker has it loaded

    from mindformers_py import cli

    def lose_peer(args):
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:9649. This is typically caused by ...")

    monkeypatch.setattr(cli, "_cmd_show", lose_peer)
    monkeypatch.setattr("mindformers_py.launcher.launch.PEER_GRACE_S", 0.0)
    monkeypatch.setenv("RANK", "1")
    assert cli.main(["show"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: rank 1 stopped: [pair.cc:553] Connection closed by peer") and err.count("\n") == 1
    assert "another rank failed or was stopped" in err
    monkeypatch.setattr(cli, "_cmd_show", lambda args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        cli.main(["show"])


def test_a_forked_worker_takes_the_launchers_environment_as_it_is_now():
    """Workers fork from a fork server that kept the environment of the moment it started. A variable the launching
    program has unset since (an earlier launch's layout, a test's setting) must not reach them: in the full suite a
    stale ``MINDFORMERS_PY_LAYOUT`` made recipe ranks run an earlier test's layout. What the agent (and launch()'s
    restart log) set for the worker stays."""
    code = (
        "import os\n"
        "from mindformers_py.launcher.launch import RESTART_LOG_ENV, adopt_environment\n"
        "os.environ.update(STALE='1', RANK='3', TORCHELASTIC_RUN_ID='run', **{RESTART_LOG_ENV: 'log'})\n"
        "adopt_environment({'KEPT': '2', 'RANK': '9', 'STALE_NOT': 'x'})\n"
        "print(sorted(os.environ.items()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.pathsep.join(sys.path)}).stdout
    import ast

    from mindformers_py.launcher.launch import RESTART_LOG_ENV

    assert ast.literal_eval(out) == sorted({"KEPT": "2", "STALE_NOT": "x", "RANK": "3", "TORCHELASTIC_RUN_ID": "run",
                                RESTART_LOG_ENV: "log"}.items())
