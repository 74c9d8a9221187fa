"""Process-group set-up and tear-down, in one place: the one module that creates process groups
and meshes. torchrun's environment is read by :mod:`admm_dist.engine.env`.

- :func:`backend_for` is the single place that maps a device to a backend
  (``cuda`` -> ``nccl``, ``cpu`` -> ``gloo``).
- :func:`build_mesh` creates, from a run's placement, every group beyond the default and control
  ones: for W = k x N the (N, k) device mesh of the seat groups and of the columns across seats
  (:class:`RankMesh`; :mod:`admm_dist.engine.seat_group`).
- :func:`rehearsal_world` is one rank of a world of any size in one process, on torch's
  ``fake`` backend, for rehearsing a job (:mod:`admm_dist.training.rehearsal`).
- :func:`distributed` is a context manager that binds the device from
  ``LOCAL_RANK``, creates the default process group with a collective timeout and
  the gloo group of control agreement (:mod:`admm_dist.engine.control`), enters only
  once every rank holds both, and always destroys them on the way out, on success
  and on failure. It joins this rank to the roll call (:mod:`admm_dist.engine.job`); a failure of
  the backend that leaves its body (:func:`backend_failure`: a collective outside the consensus
  transport, such as FSDP's gathers, whose peer went away or ran out of time) leaves it as a
  :class:`~admm_dist.engine.comm.communicator.CommError` of one line, and a failure that is
  said in one line is claimed as the job's first (:class:`~admm_dist.engine.job.FirstFailure`)
  before the group is torn down, so a peer that fails of the teardown cannot claim it first.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import re
import time
import uuid
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from admm_dist.core.constants import DEFAULT_TIMEOUT_S
from admm_dist.core.errors import RunError, UserError, describe
from admm_dist.engine.comm.communicator import CommError, first_line
from admm_dist.engine.env import DistConfigError, DistEnv, read_env
from admm_dist.engine.job import FirstFailure, RollCall, roll_call
from admm_dist.engine.placement import Placement
from admm_dist.engine.seat_group import SeatGroup

BACKENDS = {"cuda": "nccl", "cpu": "gloo"}
DEVICE_FORMS = "auto, cpu, cuda or cuda:N"   # what a device setting may be (check_device)
_CUDA_N = re.compile(r"cuda:[0-9]+")


def check_device(requested: object) -> str:
    """``requested`` if it is one of :data:`DEVICE_FORMS` (auto, cpu, cuda, cuda:N), else a
    :class:`DistConfigError` naming them; needs no GPU, so a config is checked before any runs."""
    text = str(requested).strip()
    if text in ("auto", "cpu", "cuda") or _CUDA_N.fullmatch(text):
        return text
    raise DistConfigError(f"device={requested!r} is not supported: use {DEVICE_FORMS} "
                          "(e.g. device=cuda:0)")


def device_type(requested: str) -> str:
    """The type of device a job runs on: ``auto`` is CUDA where present, else CPU."""
    requested = check_device(requested)
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested.split(":")[0]


def resolve_device(requested: str, local_rank: int = 0) -> torch.device:
    """``auto`` picks CUDA when present; a CUDA device is bound from LOCAL_RANK."""
    requested = check_device(requested)
    dev = torch.device(device_type(requested) if requested == "auto" else requested)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DistConfigError(f"device {requested!r} requested but CUDA is not available: "
                                  f"use --device cpu")
        n = torch.cuda.device_count()
        if dev.index is None:
            if local_rank >= n:
                raise DistConfigError(
                    f"LOCAL_RANK={local_rank} but only {n} CUDA device(s) are visible: "
                    f"use --nproc_per_node <= {n} or --device cpu")
            dev = torch.device("cuda", local_rank)
        elif dev.index >= n:
            raise DistConfigError(f"device {requested!r} but only {n} CUDA device(s) are visible: "
                                  f"use cuda:0 .. cuda:{n - 1}, cuda or auto")
    return dev


def backend_for(device: torch.device) -> str:
    """The one place where a device chooses its process-group backend."""
    try:
        return BACKENDS[device.type]
    except KeyError:
        raise DistConfigError(f"no backend for device type {device.type!r}: use cpu or cuda") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistContext:
    """A live process group (or a world of one) and the device bound to this rank."""

    env: DistEnv
    device: torch.device
    backend: Optional[str]
    timeout: datetime.timedelta
    # the gloo group of control agreement (admm_dist.engine.control): CPU under any backend
    control: Optional[dist.ProcessGroup] = None
    roll_call: Optional[RollCall] = None   # names the ranks that went away (admm_dist.engine.job)

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size


_POLL_S = 0.05   # how often rank 0 looks for joining ranks while a generation forms


def agree_generation(store: dist.Store, rank: int, world_size: int,
                     timeout: datetime.timedelta) -> int:
    """A number that every rank of this process group, and no rank of an earlier one, holds.

    torchrun's agent keeps one store for the whole job, across restarts and membership
    changes, and tells a worker nothing that names the current rendezvous round: the
    restart counts of two agents differ once a host has left or come back (pytorch#135712),
    so keys built from them would mix a live attempt with a dead one. Instead rank 0 draws
    a fresh generation with an atomic ``add``; every other rank posts a random nonce under
    its rank, rank 0 answers each nonce it sees with the generation, and the rank confirms.
    A stale nonce left by a dead attempt is answered too, but nobody confirms it, so rank 0
    waits until each rank of *this* group has confirmed, then says go (or, past ``timeout``,
    that it gave up, so no rank waits longer than ``timeout`` in all).
    """
    deadline = time.monotonic() + timeout.total_seconds()
    base = f"admm_dist/agree/w{world_size}"
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"{base}/join/{rank}", nonce)
        grant = f"admm_dist/agree/grant/{nonce}"
        store.wait([grant], timeout)
        generation = int(store.get(grant))
        store.set(f"{base}/ack/{generation}/{rank}", b"1")
        while not store.check([f"{base}/go/{generation}"]):
            if store.check([f"{base}/abort/{generation}"]):
                raise dist.DistStoreError(f"rank 0 gave up forming generation {generation}: "
                                          f"{store.get(f'{base}/abort/{generation}').decode()}")
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"rank 0 did not complete generation {generation} of the "
                                          f"{world_size}-rank group within {timeout.total_seconds():g} s")
            time.sleep(_POLL_S)
        return generation
    generation = int(store.add("admm_dist/generation", 1))
    pending = set(range(1, world_size))
    answered: dict[int, bytes] = {}
    while pending:
        for r in sorted(pending):
            join = f"{base}/join/{r}"
            if store.check([join]):
                nonce = store.get(join)
                if answered.get(r) != nonce:
                    store.set(f"admm_dist/agree/grant/{nonce.decode()}", str(generation))
                    answered[r] = nonce
            if store.check([f"{base}/ack/{generation}/{r}"]):
                pending.discard(r)
        if not pending:
            break
        if time.monotonic() > deadline:
            why = (f"rank(s) {sorted(pending)} did not join generation {generation} of the "
                   f"{world_size}-rank group within {timeout.total_seconds():g} s")
            store.set(f"{base}/abort/{generation}", why)
            raise dist.DistStoreError(why)
        time.sleep(_POLL_S)
    store.set(f"{base}/go/{generation}", b"1")
    return generation


def _init_group(env: DistEnv, backend: str, timeout: datetime.timedelta, from_environ: bool,
                kwargs: dict) -> Optional[str]:
    """Create the default group; the key space of this group in the agent's store (None without one)."""
    if env.agent_store:
        # torchrun's agent keeps one store across restarts: give every group its own
        # key space, or a restarted rank would read a dead attempt's addresses.
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                              is_master=False, timeout=timeout)
        generation = agree_generation(store, env.rank, env.world_size, timeout)
        prefix = f"admm_dist/gen_{generation}"
        dist.init_process_group(backend=backend, store=dist.PrefixStore(prefix, store), rank=env.rank,
                                world_size=env.world_size, timeout=timeout, **kwargs)
        return prefix
    dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size,
                            init_method=("env://" if from_environ
                                         else f"tcp://{env.master_addr}:{env.master_port}"),
                            timeout=timeout, **kwargs)
    return None


def _await_every_rank() -> None:
    """Return once every rank of the new gloo group holds it (bounded by the group's timeout).

    gloo's ``connectFullMesh`` returns on the rank that dials a pair as soon as it has sent its
    greeting, before the rank it dialled has taken the connection (that one may still be waiting
    on the store for the addresses, e.g. descheduled on a loaded machine), and torch adds no
    barrier after ``init_process_group`` (``TORCH_DIST_INIT_BARRIER`` is 0 by default). A rank
    that then sends nothing and leaves (``destroy_process_group``) would close the connection
    under its peer, whose set-up fails with "Gloo connectFullMesh failed ... Connection closed
    by peer". No rank leaves the set-up before every rank has finished it. (Only gloo: NCCL,
    given ``device_id``, creates its communicator in ``init_process_group`` with every rank at
    once; that path is left as it was.)
    """
    dist.barrier()


@contextlib.contextmanager
def distributed(device: str = "auto", *, timeout_s: float = DEFAULT_TIMEOUT_S,
                env: Optional[DistEnv] = None) -> Iterator[DistContext]:
    """Set up the default process group for this worker and always tear it down.

    ``timeout_s`` bounds every collective and point-to-point wait: a peer that
    died or diverged makes the others fail with an error instead of hanging.
    The body runs once every rank has formed the group (:func:`_await_every_rank`),
    so a rank that leaves at once cannot break a peer's set-up. A failure of the backend that
    leaves the body (:func:`backend_failure`) leaves as a one-line :class:`CommError`; anything
    else keeps its own type and traceback.
    """
    if timeout_s <= 0:
        raise DistConfigError(f"timeout_s={timeout_s}: the collective timeout must be > 0 seconds")
    from_environ = env is None
    env = read_env() if from_environ else env
    dev = resolve_device(device, env.local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not env.is_distributed:
        yield DistContext(env=env, device=dev, backend=None, timeout=timeout)
        return
    backend = backend_for(dev)
    if dist.is_initialized():
        raise DistConfigError("a default process group already exists in this process: "
                              "call distributed() once per worker")
    kwargs = {}
    if dev.type == "cuda":
        kwargs["device_id"] = dev
    try:
        prefix = _init_group(env, backend, timeout, from_environ, kwargs)
        if backend == "gloo":
            _await_every_rank()
        control = dist.new_group(backend="gloo", timeout=timeout)
        dist.barrier(group=control)   # every rank holds it before any leaves (as _await_every_rank)
    except (RuntimeError, dist.DistError) as e:   # a peer stopped, died or is unreachable
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        first = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
        raise DistConfigError(
            f"rank {env.rank} could not form the process group of {env.world_size} ranks within "
            f"timeout_s={timeout_s:g} ({type(e).__name__}: {first}): another rank stopped, died or cannot be "
            "reached; check every rank's log, GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME and the rendezvous "
            "address") from None
    except BaseException:   # interrupted (Ctrl-C, SIGTERM) while the group formed: torn down too
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        raise
    roll = roll_call(env, prefix) if prefix is not None else None
    try:
        yield DistContext(env=env, device=dev, backend=backend, timeout=timeout, control=control,
                          roll_call=roll)
    except Exception as e:
        failure = e
        if backend_failure(e):
            failure = CommError(f"rank {env.rank}: a collective between ranks failed ({first_line(e)})")
        if isinstance(failure, (UserError, RunError, OSError)):
            # a failure said in one line: claimed while the group stands, so that a peer that
            # fails of this rank's teardown cannot claim it first
            FirstFailure(env).claim(describe(failure))
        if failure is e:
            raise
        raise failure from e
    finally:
        if roll is not None:
            roll.leave()
        # Destroy on success and on failure; a failing peer must not keep us alive.
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


# gloo's own text when a peer went away or a wait ran out (a RuntimeError, not a DistError)
_LOST_PEER = re.compile(r"Connection (?:closed|reset) by peer|Timed out waiting|timed out connecting|"
                        r"Operation timed out|Application timeout caused pair closure|Broken pipe")

@contextlib.contextmanager
def rehearsal_world(rank: int, world_size: int, *, local_world_size: Optional[int] = None,
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[DistContext]:
    """Rank ``rank`` of a world of ``world_size`` ranks in this one process, on torch's ``fake``
    backend: every collective returns at once and writes nothing, so a rank's code runs at the
    job's real world size with no peers (a rehearsal: :mod:`admm_dist.training.rehearsal`). The
    device is the CPU (a ``cuda`` mesh needs a CUDA build; bytes do not depend on the device).
    No control group and no roll call: nothing is agreed."""
    from torch.testing._internal.distributed.fake_pg import FakeStore   # registers the backend

    if dist.is_initialized():
        raise DistConfigError("a default process group already exists in this process: rehearse "
                              "in a process of its own")
    per_node = local_world_size or world_size
    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank % per_node,
                  master_addr="rehearsal", master_port=1)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield DistContext(env=env, device=torch.device("cpu"), backend="fake",
                          timeout=datetime.timedelta(seconds=timeout_s))
    finally:
        dist.destroy_process_group()



def backend_failure(e: BaseException) -> bool:
    """Whether ``e`` is the backend saying that a peer went away or a wait ran out: torch's
    ``DistBackendError``, ``DistNetworkError`` or ``DistStoreError``, or a plain ``RuntimeError``
    of gloo's with such a text. The one place that tells these from a bug, which keeps its
    traceback."""
    if isinstance(e, (dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError)):
        return True
    return type(e) is RuntimeError and _LOST_PEER.search(str(e)) is not None


@dataclasses.dataclass(frozen=True)
class RankMesh:
    """Where this rank sits, built once from a :class:`~admm_dist.engine.placement.Placement` by
    :func:`build_mesh`; every group a run uses is taken from here.

    W = k x N: a device mesh of shape (N, k), dims ``("seat", "shard")``, rank s k + j at [s, j].
    Along ``shard`` are the k ranks of one seat (the seat group, and FSDP2's mesh with
    ``shard_backbone``); along ``seat`` the N ranks j, k + j, ... of column j, one per seat:
    column 0 is the leaders, who run the consensus; every rank's communicator is over its own
    column, so a rank only ever holds groups it belongs to. W <= N: the default group carries
    the consensus (``across`` is None) and each rank is a seat group of its own."""
    placement: Placement
    seat: SeatGroup                            # the ranks of this rank's seat (itself when k = 1)
    across: Optional[dist.ProcessGroup] = None   # this rank's column across seats (None: the default group)
    device_mesh: Optional[DeviceMesh] = None   # ("seat", "shard"), when k > 1
    shard: Optional[DeviceMesh] = None         # the 1-D mesh of this rank's seat group (FSDP2's), when k > 1


def build_mesh(placement: Placement, ctx: DistContext) -> RankMesh:
    """This rank's :class:`RankMesh` of ``placement``: the one place, with :func:`distributed`,
    that creates process groups. Every rank creates every group, in the same order, as
    ``new_group`` requires, each bounded by the run's timeout."""
    if placement.k == 1 or not ctx.env.is_distributed:
        return RankMesh(placement, SeatGroup())
    n, k = placement.n_nodes, placement.k
    grid = torch.arange(placement.world).view(n, k)
    rows = [dist.new_group(grid[s].tolist(), timeout=ctx.timeout) for s in range(n)]
    columns = [dist.new_group(grid[:, j].tolist(), timeout=ctx.timeout) for j in range(k)]
    seat, index = divmod(ctx.rank, k)
    mesh = DeviceMesh.from_group([columns[index], rows[seat]], ctx.device.type, mesh=grid,
                                 mesh_dim_names=("seat", "shard"))
    own = mesh.get_group("shard")
    # FSDP2 gets a mesh of the seat group's own process group: one sliced out of this one
    # (``mesh["shard"]``) left the layers' weights sharded in the forward on torch 2.13
    return RankMesh(placement, SeatGroup(k, index, own, ctx.timeout, leader=seat * k), mesh.get_group("seat"),
                    mesh, DeviceMesh.from_group(own, ctx.device.type))
