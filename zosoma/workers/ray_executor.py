"""Ray: units of work as Ray tasks, population workers as Ray actors, on this machine or a cluster.

Needs the `ray` extra (pip install 'zosoma[ray]'); without it, asking for Ray is a one-line error.

    connect(address)    None: start Ray on this machine (its processes end with this one, a
                        SIGKILL included: zosoma.workers.reaper); "auto": the cluster `ray start` made
                        on this machine; HOST:PORT: that cluster's head, with this machine's Ray
                        auth token when there is one. An address that does not answer, or refuses
                        the token, is one line within `timeout` seconds (Ray itself would retry,
                        printing a warning a second, for minutes).
    RayExecutor         an executor (zosoma.workers.executor): each unit is a Ray task with `cpus` CPUs
                        (as many BLAS threads) and `gpus` GPUs, retried up to `max_retries` times
                        when its worker process or its node dies. A unit is idempotent (it resumes
                        from its folder's last checkpoint), so a retry on another node continues it.
    RayWorkers          the population workers of zosoma.workers.population_workers as Ray actors.

Records reach the driver through one small actor on the driver's node (the channel): a task sends
what it yielded at most every `FLUSH_S` seconds and gets back whether the driver asked to stop.
Stop is polled there; a stopping unit checkpoints and returns as it does in a local process.

Storage: a task works in the driver's working folder on its own node, so run folders (relative or
absolute) must be on storage every node mounts at the same path. The driver writes a random token
into each run folder (RunFolder.write_token) and every task or actor reads it back before it
touches the folder: a node that sees another folder, or none, is a one-line error instead of a
silent fresh start. Results are bit for bit those of an inline run (the forwards give the same
numbers on any number of threads: zosoma.engines.cpu.threads).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

from zosoma.errors import ClusterLost, ConfigError, one_line
from zosoma.workers import reaper
from zosoma.workers.executor import THREAD_VARS
from zosoma.training.folder import RunFolder
from zosoma.workers.population_workers import Shard, ShardSpec, WorkerLost, error_line
from zosoma.training.records import Failed

EXTRA = "pip install 'zosoma[ray]'"
CONNECT_TIMEOUT_S = 15.0
FLUSH_S = 0.2  # a task sends its records (and hears of a stop) this often
TOKEN_WAIT_S = 5.0  # a network file system may show a new file a little late
# The driver gives up on a cluster whose GCS (its head) has not taken a connection for this long;
# Ray itself would wait a minute (gcs_rpc_server_reconnect_timeout_s), then end the process with
# lines of its own.
GCS_LOST_S = 5.0


def import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError(f"--executor ray needs Ray: {EXTRA}") from None
    return ray


def connect(address: str | None = None, timeout: float = CONNECT_TIMEOUT_S, num_cpus: int | None = None):
    """This process connected to Ray (once; later calls keep the first connection, though a
    HOST:PORT address is still checked to answer): a new local instance with `num_cpus` CPUs
    (default: all), or the cluster at `address`. Returns the module."""
    ray = import_ray()
    if address and address not in ("auto", "local"):
        _reachable(address, timeout)
        if "://" not in address:
            _answers(address, timeout)
    if ray.is_initialized():
        return ray
    kwargs = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    if not address or address == "local":
        reaper.start()
        try:  # in this thread: Ray's own processes end with the thread that started them
            ray.init(address="local", num_cpus=num_cpus, **kwargs)
        except Exception as e:
            raise ConfigError(f"cannot start Ray on this machine: {one_line(e)}") from None
        return ray
    outcome: list = []

    def join():
        try:
            ray.init(address=address, **kwargs)
            outcome.append(None)
        except Exception as e:  # said below, in one line
            outcome.append(e)

    thread = threading.Thread(target=join, daemon=True)  # ray.init cannot be told to give up
    thread.start()
    thread.join(timeout)
    if not outcome:
        raise ConfigError(f"no Ray cluster answered at {address} within {timeout:.0f} s (is it a Ray head's "
                          "GCS address, as `ray start --head` prints?)")
    if outcome[0] is not None:
        raise ConfigError(f"cannot connect to Ray at {address}: {one_line(outcome[0])}")
    return ray


def _reachable(address: str, timeout: float) -> None:
    """A ConfigError line unless a TCP connection to HOST:PORT (or ray://HOST:PORT) opens in time."""
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--address {address}: expected HOST:PORT, ray://HOST:PORT or auto")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise ConfigError(f"cannot reach the Ray cluster at {address} within {timeout:.0f} s: "
                          f"{e.strerror or type(e).__name__}") from None


# Asks a GCS for its cluster id once; prints nothing when it answered, else the error's name and first line.
_PROBE = """import sys
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1])
except Exception as e:
    print(type(e).__name__, str(e).splitlines()[0] if str(e) else "")
"""
TOKEN_FIX = "on the head run `ray get-auth-token` and set RAY_AUTH_TOKEN to what it prints"


def _answers(address: str, timeout: float) -> None:
    """A ConfigError line unless the Ray GCS at HOST:PORT answers within `timeout` and takes this
    machine's auth token (if it wants one). Asked in a subprocess: Ray's warnings stay there,
    and a connection that hangs is given up."""
    source = _use_token()
    try:
        probe = subprocess.run([sys.executable, "-c", _PROBE, address], capture_output=True, text=True,
                               timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"no Ray cluster answered at {address} within {timeout:.0f} s (is it a Ray head's "
                          "GCS address, as `ray start --head` prints?)") from None
    answer = probe.stdout.strip()
    if probe.returncode == 0 and not answer:
        return
    answer = answer or (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
    if not answer.startswith("AuthenticationError"):
        raise ConfigError(f"cannot connect to Ray at {address}: {answer}")
    mode = os.environ.get("RAY_AUTH_MODE", "").lower()
    if source is None:
        raise ConfigError(f"the Ray cluster at {address} refused the connection: it needs its auth token, and "
                          "this machine has none (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token); "
                          f"{TOKEN_FIX}")
    if mode != "token":
        raise ConfigError(f"the Ray cluster at {address} refused the connection: it needs its auth token, and "
                          f"RAY_AUTH_MODE={mode} here turns tokens off; set RAY_AUTH_MODE=token")
    raise ConfigError(f"the Ray cluster at {address} refused the auth token in {source}: {TOKEN_FIX}")


def _use_token() -> str | None:
    """Where Ray reads this machine's auth token from, in Ray's order (None: nowhere). With a
    token and RAY_AUTH_MODE unset, turns token mode on in this process (and the probe's), as
    ray.init does for `auto` but not for an explicit address, which the head then refuses."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if os.environ.get("RAY_AUTH_TOKEN"):
        source = "RAY_AUTH_TOKEN"
    elif path:
        if not _has_text(Path(path)) and os.environ.get("RAY_AUTH_MODE", "").lower() != "disabled":
            raise ConfigError(f"RAY_AUTH_TOKEN_PATH is {path}, which is missing or empty: put the Ray cluster's "
                              "auth token there (`ray get-auth-token` on the head prints it), or unset it")
        source = f"RAY_AUTH_TOKEN_PATH ({path})"
    else:
        default = Path.home() / ".ray" / "auth_token"
        source = str(default) if _has_text(default) else None
    if source is not None and "RAY_AUTH_MODE" not in os.environ:
        from ray._raylet import Config
        os.environ["RAY_AUTH_MODE"] = "token"
        Config.initialize("")  # Ray reads its config once; this is how ray.init switches token mode on
    return source


def _has_text(path: Path) -> bool:
    try:
        return bool(path.read_text().strip())
    except OSError:
        return False


def _thread_env(cpus: float) -> dict:
    """A unit's runtime environment: as many BLAS/OpenMP/Numba threads as it has CPUs."""
    threads = str(max(1, int(cpus)))
    return {"env_vars": {k: threads for k in THREAD_VARS}}


def _enter(cwd: str, run_dir: str, token: str, wait: float) -> None:
    """In a task or actor: work in the driver's folder and check that it is the driver's."""
    host = socket.gethostname()
    try:
        os.chdir(cwd)
    except OSError:
        raise ConfigError(f"node {host} has no folder {cwd} (the driver's working folder): run zosoma from "
                          "storage every node mounts at the same path") from None
    deadline = time.monotonic() + wait
    while RunFolder(run_dir).read_token() != token:
        if time.monotonic() >= deadline:
            raise ConfigError(f"node {host} does not see the driver's run folder {run_dir} (its token file is "
                              "missing or different): put run folders on storage every node mounts at the "
                              "same path")
        time.sleep(0.2)


class _Channel:
    """The driver's mailbox (an actor on the driver's node): records in, the stop request out."""

    def __init__(self):
        self.records, self.stop = [], False

    def put(self, records: list) -> bool:
        self.records.extend(records)
        return self.stop

    def take(self) -> list:
        records, self.records = self.records, []
        return records

    def request_stop(self) -> None:
        self.stop = True


class _Outbox:
    """A task's side of the channel: records buffered, sent every FLUSH_S seconds."""

    def __init__(self, ray, channel):
        self.ray, self.channel = ray, channel
        self.buffer, self.stop, self.sent = [], False, 0.0

    def put(self, record) -> None:
        self.buffer.append(record)
        if time.monotonic() - self.sent >= FLUSH_S:
            self.flush()

    def stopping(self) -> bool:
        if time.monotonic() - self.sent >= FLUSH_S:
            self.flush()
        return self.stop

    def flush(self) -> None:
        self.stop = self.ray.get(self.channel.put.remote(self.buffer))
        self.buffer, self.sent = [], time.monotonic()


def _run_unit(unit, channel, token: str, cwd: str, wait: float) -> None:
    """A Ray task: one unit, its records sent to the driver's channel."""
    import ray
    _enter(cwd, unit.run_dir, token, wait)
    out = _Outbox(ray, channel)
    try:
        for record in unit(out.stopping):
            out.put(record)
    finally:
        out.flush()


class _Heartbeat:
    """Whether the cluster's GCS still answers: a thread opens a TCP connection to it (HOST:PORT)
    every second; `silent` is how long it has not, once that is over GCS_LOST_S (else 0)."""

    def __init__(self, gcs: str):
        host, _, port = gcs.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)  # [::1]:6379 too
        self.last, self.done = time.monotonic(), threading.Event()
        threading.Thread(target=self._beat, daemon=True, name="zosoma-ray-heartbeat").start()

    def _beat(self) -> None:
        while not self.done.wait(1.0):
            try:
                socket.create_connection((self.host, self.port), timeout=1.0).close()
                self.last = time.monotonic()
            except OSError:
                pass

    @property
    def silent(self) -> float:
        quiet = time.monotonic() - self.last
        return quiet if quiet > GCS_LOST_S else 0.0

    def close(self) -> None:
        self.done.set()

    def lost(self, why: str) -> ClusterLost:
        return ClusterLost(f"the Ray cluster at {self.host}:{self.port} is gone ({why}: its head was stopped or "
                           "lost); every unit keeps its newest checkpoint")


class RayExecutor:
    """Units as Ray tasks: `cpus` CPUs and `gpus` GPUs each, retried up to `max_retries` times
    when a worker process or node dies. Connects at once (see `connect`), so a bad address fails
    before any work starts. A unit names the run folder it works in as `unit.run_dir`."""

    def __init__(self, address: str | None = None, cpus: float = 1, gpus: float = 0, max_retries: int = 3,
                 timeout: float = CONNECT_TIMEOUT_S, token_wait: float = TOKEN_WAIT_S):
        if not (cpus > 0 and gpus >= 0):
            raise ConfigError(f"resources per unit must be CPUs > 0 and GPUs >= 0, got {cpus} and {gpus}")
        self.ray = connect(address, timeout)
        self.cpus, self.gpus, self.max_retries, self.token_wait = cpus, gpus, max_retries, token_wait

    def run(self, units: Sequence, should_stop: Callable[[], bool] = lambda: False) -> Iterator:
        ray = self.ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        channel = ray.remote(_Channel).options(num_cpus=0, scheduling_strategy=here).remote()
        token = secrets.token_hex(16)
        for run_dir in dict.fromkeys(str(u.run_dir) for u in units):
            RunFolder(run_dir).write_token(token)
        task = ray.remote(_run_unit).options(num_cpus=self.cpus, num_gpus=self.gpus, max_retries=self.max_retries,
                                             runtime_env=_thread_env(self.cpus))
        refs = {task.remote(unit, channel, token, os.getcwd(), self.token_wait): i for i, unit in enumerate(units)}
        pending, stopping, taken, drained, lost = list(refs), False, None, False, None
        beat = _Heartbeat(ray.get_runtime_context().gcs_address)
        try:
            while not drained:
                if beat.silent:  # said in one line now; no Ray call below waits for the GCS
                    lost = beat.lost(f"no answer for {beat.silent:.0f} s")
                    raise lost
                if not stopping and should_stop():
                    channel.request_stop.remote()
                    stopping = True
                done = []
                if pending:
                    done, pending = ray.wait(pending, num_returns=len(pending), timeout=FLUSH_S, fetch_local=False)
                if taken is None:  # the records sent so far; the last asked for once every unit returned
                    taken, last = channel.take.remote(), not pending
                if ray.wait([taken], timeout=FLUSH_S)[0]:
                    yield from ray.get(taken)
                    taken, drained = None, last
                for ref in done:
                    failure = _failure(ray, ref)
                    if failure is not None:
                        yield Failed(refs[ref], failure)
        except ray.exceptions.RayError as e:  # the channel on the driver's node is gone: the cluster with it
            lost = beat.lost(type(e).__name__)
            raise lost from None
        finally:
            beat.close()
            if lost is None:  # (killing an actor of a lost cluster would wait for it)
                ray.kill(channel)


def _failure(ray, ref) -> str | None:
    """None when the task returned, else one line: the unit's own error, or how its worker died
    (after every retry was spent)."""
    try:
        ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        return error_line(e.cause) if e.cause is not None else one_line(e)
    except ray.exceptions.RayError as e:
        return one_line(e)
    return None


# --- population workers as actors ------------------------------------------------------------------

class _RemoteShard:
    """A population worker as a Ray actor: checks the folder, then holds a Shard. Errors are kept
    and raised by every call, so the driver sees their one line, not an actor's death."""

    def __init__(self, spec: ShardSpec, step: int, replay: list, token: str, cwd: str, wait: float):
        try:
            _enter(cwd, spec.run_dir, token, wait)
            self.shard, self.error = Shard(spec, step, replay), None
        except Exception as e:
            self.shard, self.error = None, e

    def call(self, method: str, *args):
        if self.error is not None:
            raise self.error
        return getattr(self.shard, method)(*args)


class RayWorkers:
    """Population workers (zosoma.workers.population_workers) as Ray actors with the executor's resources;
    an actor lost with its process or node is rebuilt by the driver, anywhere."""

    def __init__(self, executor: RayExecutor):
        self.executor, self.token, self.marked = executor, secrets.token_hex(16), set()

    def spawn(self, spec: ShardSpec, step: int, replay: Sequence = ()):
        ray, ex = self.executor.ray, self.executor
        if spec.run_dir not in self.marked:
            RunFolder(spec.run_dir).write_token(self.token)
            self.marked.add(spec.run_dir)
        actor = ray.remote(_RemoteShard).options(num_cpus=ex.cpus, num_gpus=ex.gpus, max_restarts=0,
                                                  runtime_env=_thread_env(ex.cpus))
        return _ActorHandle(ray, actor.remote(spec, step, list(replay), self.token, os.getcwd(), ex.token_wait))


class _ActorHandle:
    def __init__(self, ray, actor):
        self.ray, self.actor = ray, actor

    def call(self, method: str, *args):
        return self.actor.call.remote(method, *args)  # the ticket is the reply's ObjectRef

    def result(self, ticket):
        ray = self.ray
        try:
            return ray.get(ticket)
        except ray.exceptions.RayActorError as e:
            raise WorkerLost(one_line(e)) from None
        except ray.exceptions.RayTaskError as e:
            raise ConfigError(error_line(e.cause) if e.cause is not None else one_line(e)) from None

    def close(self):
        self.ray.kill(self.actor)
