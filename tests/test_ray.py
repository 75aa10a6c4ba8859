"""Ray (zosoma.workers.ray_executor): SOMA's experts as Ray tasks and a population over Ray actors give an
inline run's numbers bit for bit, through a lost node, a worker process killed with os._exit, a lost
actor and a driver killed with SIGKILL; a bad address, a folder the workers cannot see and a missing
Ray are one line. A head that `ray start` started with token authentication (token_head, a cluster
of its own) takes this machine's token by explicit address, and without it is one line; the Ray a
driver starts ends with it when it is SIGKILLed. One Ray instance serves the session (ray_local, 2
CPUs); the node-loss test, last, replaces it with a cluster of its own (ray_local starts it again
for any test after it)."""

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from helpers import RAY_OPTIONS, zosoma_cmd
from world import TINY_MODEL as MODEL, tiny_args
from zosoma.engines.ops import Ops
from zosoma.cli.main import cli
from zosoma.config import TrainConfig
from zosoma.errors import ConfigError
from zosoma.workers.executor import Inline
from zosoma.training.folder import RunFolder
from zosoma.workers.population_workers import Sharding
from zosoma.workers.ray_executor import RayExecutor, RayWorkers, connect
from zosoma.workers.reaper import descendants, start_time
from zosoma.training.records import Failed, Finished, Note, Step
from zosoma.runs.single import start_run
from zosoma.runs.soma import ExpertUnit, create_soma, open_soma

ray = pytest.importorskip("ray", reason="the Ray executor needs the ray extra")
from ray.cluster_utils import Cluster  # noqa: E402

# Ray workers cannot import this module (tests/ is no package): send the test's units by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CFG = TrainConfig(optimizer="sgd", steps=12, batch=2, seq_len=16, perturbations=4, lr=0.5, checkpoint_every=4)
TINY = tiny_args(2)


pytestmark = [pytest.mark.usefixtures("scratch_cwd"), pytest.mark.ray, pytest.mark.slow]  # Ray takes seconds to start


@dataclass(frozen=True)
class Watched:
    """A unit that says where each attempt runs, sleeps `pause` s after each step (so a test can
    act mid-training), and, on the first attempt only (no `marker` file yet), ends its worker
    process with os._exit after step `die_at`."""
    unit: ExpertUnit
    pause: float = 0.0
    die_at: int = 0
    marker: str = ""

    @property
    def run_dir(self):
        return self.unit.run_dir

    def __call__(self, stopping):
        yield Note(f"expert {self.unit.expert} pid {os.getpid()} node {ray.get_runtime_context().get_node_id()}")
        for record in self.unit(stopping):
            yield record
            if isinstance(record, Step):
                time.sleep(self.pause)
                if record.step == self.die_at and not os.path.exists(self.marker):
                    Path(self.marker).touch()
                    os._exit(1)


def soma_units(run_dir, two_domains, cfg=CFG):
    create_soma(run_dir, MODEL, cfg, 2, chunk_size=256, train_paths=[str(two_domains / "prose.txt"), str(two_domains / "digits.txt")])
    run = open_soma(run_dir)
    return [ExpertUnit(str(run_dir), run.soma, run.corpora[i], i, Ops()) for i in range(2)]


def final_thetas(run_dir):
    return [RunFolder(run_dir).expert(i).read_checkpoint().theta for i in range(2)]


def assert_same_experts(a, b):
    for i, (x, y) in enumerate(zip(final_thetas(a), final_thetas(b))):
        assert np.array_equal(x, y), f"expert {i}"


def attempts(records) -> dict:
    """expert -> [(pid, node)] of each attempt, from Watched's notes."""
    out: dict = {}
    for r in records:
        if isinstance(r, Note) and r.message.startswith("expert "):
            _, i, _, pid, _, node = r.message.split()
            out.setdefault(int(i), []).append((pid, node))
    return out


def test_soma_on_ray_equals_inline_from_the_command_line(tmp_path, two_domains, ray_local):
    base = ["train", "--experts", "2", "--data", str(two_domains / "prose.txt"), "--data", str(two_domains / "digits.txt"),
            "--chunk-size", "256", "--steps", "6", "-P", "4", *TINY]
    for kind in ("inline", "ray"):
        result = CliRunner().invoke(cli, base + ["--run-dir", kind, "--executor", kind])
        assert result.exit_code == 0, result.output
    assert_same_experts("inline", "ray")
    metrics = [json.loads(line) for line in Path("ray/expert1/metrics.jsonl").read_text().splitlines()]
    assert [m["comm_bytes"] for m in metrics] == [0] * 6  # SOMA's experts exchange nothing while training


def test_a_worker_killed_with_os_exit_is_retried(tmp_path, two_domains, ray_local):
    list(Inline().run(soma_units("inline", two_domains)))
    units = soma_units("ray", two_domains)
    units[0] = Watched(units[0], die_at=6, marker=str(tmp_path / "died"))
    records = list(RayExecutor(max_retries=2).run(units))
    assert not [r for r in records if isinstance(r, Failed)]
    assert (tmp_path / "died").exists() and len(attempts(records)[0]) == 2  # a second process took over
    assert sorted(r.expert for r in records if isinstance(r, Finished)) == [0, 1]
    assert_same_experts("inline", "ray")


def kill_and_wait(actor):
    """ray.kill returns before the actor dies: wait, so the next step is the one that meets the loss."""
    ray.kill(actor)
    with pytest.raises(ray.exceptions.RayActorError):
        while True:
            ray.get(actor.call.remote("state"))


def test_a_population_over_ray_actors_survives_a_lost_actor(tmp_path, two_domains, ray_local):
    paths = [str(two_domains / "prose.txt")]
    list(start_run("one", MODEL, CFG, paths, ops=Ops()))

    class Spy(RayWorkers):
        """Keeps the actors' handles, to kill one."""

        def spawn(self, spec, step, replay=()):
            self.handles = getattr(self, "handles", []) + [super().spawn(spec, step, replay)]
            return self.handles[-1]

    spy = Spy(RayExecutor())
    notes = []
    for r in start_run("w2", MODEL, CFG, paths, sharding=Sharding(spy, 2), ops=Ops()):
        if isinstance(r, Step):
            notes += r.notes
            if r.step == 6:  # the checkpoint is at step 4
                kill_and_wait(spy.handles[0].actor)
    assert len(notes) == 1 and "rebuilt from the checkpoint at step 4 and 2 logged steps" in notes[0]
    assert np.array_equal(RunFolder("w2").read_checkpoint().theta, RunFolder("one").read_checkpoint().theta)


def test_comparison_jobs_run_as_ray_tasks(tmp_path, ray_local):
    Path("one.toml").write_text('title = "one"\nseeds = [0]\nflops = 2e8\ncurve_points = 1\ncurve_bytes = 256\n'
                                'train = {batch = 2, seq_len = 8}\n[[method]]\nname = "SPSA P=2"\n'
                                'model = {embed = 6, hidden = 11, layers = 1}\ntrain = {perturbations = 2}\n')
    result = CliRunner().invoke(cli, ["compare", "one.toml", "--out", "out", "--executor", "ray"])
    assert result.exit_code == 0, result.output
    assert "finished spsa-p-2-seed0" in result.output and Path("out/runs/spsa-p-2-seed0/result.json").exists()


def test_a_folder_the_workers_cannot_see_is_one_line(tmp_path, two_domains, ray_local, monkeypatch):
    units = soma_units("run", two_domains)
    monkeypatch.setattr(RunFolder, "write_token", lambda self, token: None)  # the workers see another disk
    failed = [r for r in RayExecutor(token_wait=0).run(units) if isinstance(r, Failed)]
    assert sorted(f.unit for f in failed) == [0, 1]
    assert "does not see the driver's run folder run" in failed[0].error and "\n" not in failed[0].error
    assert RunFolder("run").expert(0).read_checkpoint().step == 0  # nothing trained anywhere
    with pytest.raises(ConfigError, match="does not see the driver's run folder"):
        list(start_run("one", MODEL, CFG, [str(two_domains / "prose.txt")],
                       sharding=Sharding(RayWorkers(RayExecutor(token_wait=0)), 2), ops=Ops()))


def test_an_unreachable_address_is_one_line_within_the_timeout(tmp_path, two_domains):
    t0 = time.monotonic()
    result = CliRunner().invoke(cli, ["train", "--experts", "2", "--data", str(two_domains / "prose.txt"), "--executor", "ray",
                                      "--address", "127.0.0.1:1", "--run-dir", "run"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.strip().splitlines()[-1] == ("Error: cannot reach the Ray cluster at 127.0.0.1:1 within "
                                                      "15 s: Connection refused")
    assert time.monotonic() - t0 < 15 and not Path("run").exists()


def test_without_ray_the_executor_is_one_line_naming_the_extra(tmp_path, two_domains, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if it were not installed
    args = ["train", "--experts", "2", "--data", str(two_domains / "prose.txt"), "--executor", "ray"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == "Error: --executor ray needs Ray: pip install 'zosoma[ray]'"


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_driver_killed_with_sigkill_reruns_without_retraining_finished_experts(tmp_path, two_domains, ray_local):
    address = ray.get_runtime_context().gcs_address
    # --cpus-per-unit 2 on a 2-CPU cluster: one expert after the other
    cmd = zosoma_cmd() + ["train", "--experts", "2", "--data", str(two_domains / "prose.txt"), "--data",
                          str(two_domains / "digits.txt"), "--chunk-size", "256", "--steps", "200", "-P", "16", *TINY,
                          "--checkpoint-every", "50", "--executor", "ray", "--address", address, "--cpus-per-unit", "2"]
    driver = subprocess.Popen(cmd + ["--run-dir", "run"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    experts = [Path("run") / f"expert{i}" for i in range(2)]

    def steps(folder):
        lines = (folder / "metrics.jsonl").read_text().splitlines() if (folder / "metrics.jsonl").exists() else []
        return len(lines)

    def finished(folder):  # its last checkpoint is written: the 200th metrics line comes before it
        return (folder / "checkpoint.h5").exists() and RunFolder(folder).read_checkpoint().step == 200

    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (sorted(map(steps, experts))[0] > 0 and any(map(finished, experts))):
        assert driver.poll() is None, driver.stderr.read().decode()
        time.sleep(0.05)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    done = next(i for i in range(2) if finished(experts[i]))
    other = experts[1 - done]
    assert steps(other) < 200, "the second expert finished before the driver could be killed"
    time.sleep(0.5)
    left = steps(other)
    time.sleep(1)
    assert steps(other) == left  # its task ended with the driver: nobody trains without the driver
    before = {name: sha(experts[done] / name) for name in ("checkpoint.h5", "metrics.jsonl")}
    rerun = subprocess.run(zosoma_cmd() + ["train", "--resume", "run", "--executor", "ray", "--address", address,
                                           "--cpus-per-unit", "2"], capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert {name: sha(experts[done] / name) for name in before} == before  # not retrained, not rewritten
    assert RunFolder(other).read_checkpoint().step == 200 and steps(other) == 200


def ray_free_env(**extra) -> dict:
    """This process's environment without any RAY_ variable (ray.init sets RAY_AUTH_MODE here), plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, **extra}


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def short_temp_dir() -> str:
    """A private Ray temp root in /tmp: Ray's socket paths under it must stay short."""
    return tempfile.mkdtemp(prefix="zr", dir="/tmp")


@dataclass
class Head:
    address: str
    token: str
    home: Path  # a HOME whose ~/.ray/auth_token holds the token, as on the head's machine


def start_head(home: Path, temp: str) -> tuple[subprocess.Popen, str, Path]:
    """`ray start --head --block` with HOME `home`, its own temp dir and free ports, 2 CPUs, in a
    session of its own; returns it once started, with its address and its log."""
    names = ["port", "node-manager-port", "object-manager-port", "dashboard-port", "dashboard-agent-listen-port",
             "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port"]
    ports = dict(zip(names, free_ports(len(names))))
    log = Path(temp) / "head.log"
    cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--num-cpus", "2",
           "--temp-dir", temp, "--include-dashboard", "false", "--disable-usage-stats",
           "--object-store-memory", str(RAY_OPTIONS["object_store_memory"])]
    cmd += [arg for name, port in ports.items() for arg in (f"--{name}", str(port))]
    with open(log, "wb") as out:
        head = subprocess.Popen(cmd, env=ray_free_env(HOME=str(home)), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + 120
    while "Ray runtime started" not in log.read_text():
        if head.poll() is not None or time.monotonic() > deadline:
            head.kill()
            pytest.fail(log.read_text()[-3000:])
        time.sleep(0.2)
    return head, f"127.0.0.1:{ports['port']}", log


@pytest.fixture(scope="module")
def token_head(tmp_path_factory):
    """A Ray head as `ray start --head` starts one on a machine where a token exists (Ray 2.59 on
    then turns token authentication on). Stopped by SIGTERM to its own `ray start --block`
    process, which takes its Ray processes with it (a bare `ray stop` would stop every Ray on the
    machine)."""
    home, token, temp = tmp_path_factory.mktemp("home"), secrets.token_hex(32), short_temp_dir()
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(token)
    head, address, log = start_head(home, temp)
    try:
        assert "Token authentication is enabled" in log.read_text()
        yield Head(address, token, home)
    finally:
        head.terminate()
        try:
            head.wait(90)
        except subprocess.TimeoutExpired:
            head.kill()
        shutil.rmtree(temp, ignore_errors=True)


def soma_args(two_domains, steps):
    return ["train", "--experts", "2", "--data", str(two_domains / "prose.txt"), "--data",
            str(two_domains / "digits.txt"), "--chunk-size", "256", "--steps", str(steps), "-P", "2", *TINY,
            "--executor", "ray", "--run-dir", "run"]


def test_a_head_with_token_authentication_takes_this_machines_token(tmp_path, two_domains, token_head):
    """The token the head read (~/.ray/auth_token) is the driver's too: by explicit address, as with
    --address auto, SOMA trains on that cluster."""
    result = subprocess.run(zosoma_cmd() + soma_args(two_domains, 3) + ["--address", token_head.address],
                            env=ray_free_env(HOME=str(token_head.home)), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "InvalidAuthToken" not in result.stderr
    assert [RunFolder("run").expert(i).read_checkpoint().step for i in range(2)] == [3, 3]


def test_a_head_with_token_authentication_and_no_token_here_is_one_line_at_once(tmp_path, two_domains, token_head):
    """No token, a wrong one, or a RAY_AUTH_TOKEN_PATH to nothing: one line that says how to give the
    token, within seconds (Ray itself retries for 20 s, printing a warning a second); the right
    token in RAY_AUTH_TOKEN connects."""
    nowhere = tmp_path / "home"
    nowhere.mkdir()
    fix = "on the head run `ray get-auth-token` and set RAY_AUTH_TOKEN to what it prints"
    cases = [({}, f"Error: the Ray cluster at {token_head.address} refused the connection: it needs its auth "
                  f"token, and this machine has none (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token); {fix}"),
             ({"RAY_AUTH_TOKEN": "0" * 64}, f"Error: the Ray cluster at {token_head.address} refused the auth token in "
                                            f"RAY_AUTH_TOKEN: {fix}"),
             ({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "none")}, f"Error: RAY_AUTH_TOKEN_PATH is {tmp_path / 'none'}, "
                                                               "which is missing or empty: put the Ray cluster's auth "
                                                               "token there (`ray get-auth-token` on the head prints "
                                                               "it), or unset it")]
    for extra, line in cases:
        t0 = time.monotonic()
        result = subprocess.run(zosoma_cmd() + soma_args(two_domains, 3) + ["--address", token_head.address],
                                env=ray_free_env(HOME=str(nowhere), **extra), capture_output=True, text=True,
                                timeout=120)
        assert (result.returncode, result.stdout, result.stderr.strip()) == (1, "", line)
        assert time.monotonic() - t0 < 10 and not Path("run").exists()
    connects = ("import sys\nfrom zosoma.workers.ray_executor import connect\n"
                "print(connect(sys.argv[1]).cluster_resources()['CPU'])")
    result = subprocess.run([sys.executable, "-c", connects, token_head.address], capture_output=True, text=True,
                            env=ray_free_env(HOME=str(nowhere), RAY_AUTH_TOKEN=token_head.token), timeout=120)
    assert result.stdout.strip() == "2.0", result.stderr[-3000:]


def test_a_head_killed_under_a_running_driver_is_one_line_with_the_resume_hint_within_seconds(tmp_path, two_domains):
    """The head of the cluster a SOMA run trains on is killed (SIGKILL to all its processes): the
    driver ends within seconds (Ray alone would wait a minute for its GCS, then end the process
    with lines of its own) with exit code 1 and one line of its own saying how to go on; the
    experts keep their checkpoints."""
    temp = short_temp_dir()
    head, address, _ = start_head(tmp_path, temp)
    driver = None
    try:
        driver = subprocess.Popen(zosoma_cmd() + soma_args(two_domains, 100000) + ["--address", address],
                                  env=ray_free_env(HOME=str(tmp_path)), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        metrics = [Path("run") / f"expert{i}" / "metrics.jsonl" for i in range(2)]
        deadline = time.monotonic() + 240
        while not all(m.exists() and m.stat().st_size > 1000 for m in metrics):  # both experts train
            assert driver.poll() is None and time.monotonic() < deadline, driver.communicate()
            time.sleep(0.1)
        os.killpg(head.pid, signal.SIGKILL)
        killed = time.monotonic()
        out, err = driver.communicate(timeout=120)
        took = time.monotonic() - killed
    finally:
        if driver is not None:
            driver.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)
    assert driver.returncode == 1 and took < 20, (took, err[-3000:])
    last = err.strip().splitlines()[-1]
    assert last.startswith("Error: the Ray cluster at ") and " is gone (" in last, err[-3000:]
    assert last.endswith("every unit keeps its newest checkpoint. Continue with: zosoma train --resume run")
    assert "Traceback" not in err
    assert all(RunFolder("run").expert(i).read_checkpoint().step >= 0 for i in range(2))


def test_an_address_that_does_not_answer_is_one_line_and_nothing_else(tmp_path, ray_local, capfd):
    with socket.create_server(("0.0.0.0", 0)) as silent:  # takes connections, never answers
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as e:
            connect(address, timeout=2)
    assert str(e.value) == (f"no Ray cluster answered at {address} within 2 s (is it a Ray head's GCS address, as "
                            "`ray start --head` prints?)")
    assert time.monotonic() - t0 < 6
    assert capfd.readouterr() == ("", "")  # none of Ray's warnings


def alive(processes: dict) -> dict:
    return {pid: name for pid, (t, name) in processes.items() if start_time(pid) == t}


def holding_files_under(root: str) -> set:
    """The processes with a file open under `root` (a Ray temp root: every process of its
    instance keeps its log files there)."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith(root) for fd in os.listdir(f"/proc/{pid}/fd")):
                found.add(int(pid))
        except OSError:
            pass
    return found


def named(pids) -> dict:
    """pid -> (start time, name: its first command-line word, as Ray's processes set it)."""
    out = {}
    for pid in pids:
        try:
            out[pid] = (start_time(pid), Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode())
        except OSError:
            pass
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ray_started_by_a_driver_ends_within_seconds_of_its_sigkill(tmp_path, two_domains):
    """The Ray a driver starts (no --address; its own temp root here) ends with it: the GCS, the
    raylet, its agents and workers, all gone within 5 s of a SIGKILL mid-training (without the
    reaper, the agents stay a minute)."""
    temp, log = short_temp_dir(), tmp_path / "driver.log"
    with open(log, "wb") as out:
        driver = subprocess.Popen(zosoma_cmd() + soma_args(two_domains, 5000), stdout=out, stderr=subprocess.STDOUT,
                                  env=ray_free_env(RAY_TMPDIR=temp, HOME=str(tmp_path)))
    ray_side = {}
    try:
        metrics = [Path("run") / f"expert{i}" / "metrics.jsonl" for i in range(2)]
        deadline = time.monotonic() + 240
        while not all(m.exists() and m.stat().st_size for m in metrics):  # both experts train
            assert driver.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        ray_side = named(holding_files_under(temp) | set(descendants(driver.pid)))
        names = " ".join(name for _, name in ray_side.values())
        assert "raylet" in names and "ray::DashboardAgent" in names and "ray::RuntimeEnvAgent" in names, names
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + 5
        while alive(ray_side) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(ray_side)
    finally:
        driver.kill()
        for pid in alive(ray_side):  # this test's own leftovers, if it failed
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


def test_a_lost_node_changes_nothing_but_the_time(tmp_path, two_domains):
    """Two worker nodes of one CPU each under a head of none; one node is removed while both
    experts train: its expert is retried on a node added in its place, from its last
    checkpoint, and ends where an inline run ends, bit for bit."""
    cfg = TrainConfig(**{**CFG.__dict__, "steps": 40, "checkpoint_every": 5})
    list(Inline().run(soma_units("inline", two_domains, cfg)))
    units = [Watched(u, pause=0.05) for u in soma_units("ray", two_domains, cfg)]
    ray.shutdown()  # the session's instance, if any
    fast = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 200, "health_check_failure_threshold": 5}
    store = RAY_OPTIONS["object_store_memory"]
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, include_dashboard=False,
                                                                 object_store_memory=store, _system_config=fast))
    try:
        nodes = [cluster.add_node(num_cpus=1, object_store_memory=store) for _ in range(2)]
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        records, removed = [], False
        for r in RayExecutor(max_retries=3).run(units):
            records.append(r)
            if not removed and isinstance(r, Step) and r.step >= 10:
                cluster.remove_node(nodes[0])
                cluster.add_node(num_cpus=1, object_store_memory=store)
                removed = True
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert removed and not [r for r in records if isinstance(r, Failed)]
    retried = [i for i, runs in attempts(records).items() if len(runs) == 2]
    assert len(retried) == 1 and len({node for _, node in attempts(records)[retried[0]]}) == 2
    assert_same_experts("inline", "ray")
