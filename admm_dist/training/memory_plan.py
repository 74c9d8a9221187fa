"""Will a job fit its devices? The verdict on a job's rehearsed ranks, the change that makes a job
fit, and the check a job runs on its own rank before it reads any weights.

:func:`rehearse_job` rehearses one rank of each kind the job has (:mod:`admm_dist.training.rehearsal`:
a seat's only rank; or a seat group's leader and a follower). :func:`fits` is the verdict: every
peak at most :data:`HEADROOM` of the device's memory (the CUDA context and the allocator's slack
are not counted). :func:`find_fix` tries the changes of :func:`changes` in the order of what they
cost, each rehearsed, and returns the first that fits. ``python -m admm_dist.plan`` prints all of
it (:mod:`admm_dist.cli.plan`); :func:`check_before_loading` is the trainer's: its own rank
rehearsed before the backbone's weights are read, and a job that will not fit refused in one line
naming the change that fits (``plan_memory=false`` turns it off). See docs/placement.md.
"""
from __future__ import annotations

import concurrent.futures
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from admm_dist.core import config_file
from admm_dist.core.errors import UserError
from admm_dist.core.text import parse_size, size_text
from admm_dist.engine.dist import device_type
from admm_dist.engine.env import DistEnv
from admm_dist.engine.placement import Placement
from admm_dist.engine.seat_group import check_micro_batches
from admm_dist.training import workers as forkserver
from admm_dist.training.config import TrainConfig

HEADROOM = 0.9          # the share of a device's memory a plan may fill
Log = Callable[[str], None]


def rehearse_one(argv: List[str], world: int, rank: int, per_node: int, device_memory: int,
                 device: str = "cuda") -> dict:
    """One rank's rehearsal, as a dict (run in a process of its own by :func:`rehearse_job`'s pool:
    one fake world per process at a time)."""
    from admm_dist.core.libraries import quiet_libraries
    from admm_dist.training.rehearsal import rehearse

    quiet_libraries()
    cfg = config_file.load(TrainConfig, argv)
    return rehearse(cfg, world, rank, per_node=per_node, device=device, device_memory=device_memory).to_dict()


def kinds(n_nodes: int, world: int) -> List[int]:
    """One rank of each kind: rank 0 (a seat's only rank, or a leader: the most nodes, the
    consensus) and, with k > 1 ranks per seat, rank 1 (a follower)."""
    return [0, 1] if world > n_nodes else [0]


def rehearse_job(argv: List[str], nnodes: int, per_node: int, device_memory: int,
                 pool: Optional[concurrent.futures.Executor] = None, device: str = "cuda") -> List[dict]:
    """Every kind of rank of the job of ``argv`` on ``nnodes`` x ``per_node`` ranks: in this
    process one after another, or two at a time in ``pool``'s processes."""
    cfg = config_file.load(TrainConfig, argv)      # bad settings: refused here, as the trainer would
    world = nnodes * per_node
    placement = Placement(cfg.n_nodes(), world)      # a world it cannot place: refused here
    check_micro_batches(cfg.micro_batches, placement.k)   # before any rehearsal starts a process
    ranks = kinds(cfg.n_nodes(), world)
    if len(ranks) == 1 or pool is None:
        return [rehearse_one(argv, world, r, per_node, device_memory, device) for r in ranks]
    n = len(ranks)
    return list(pool.map(rehearse_one, [argv] * n, [world] * n, ranks, [per_node] * n, [device_memory] * n,
                         [device] * n))


def fits(plans: Sequence[dict], device_memory: int) -> bool:
    return all(p["peak"] <= HEADROOM * device_memory for p in plans)


def changes(argv: List[str], nnodes: int, per_node: int, resident_fits: bool
            ) -> List[Tuple[str, List[str], int, int]]:
    """The changes tried when a job does not fit, in the order of what they cost: (what, argv,
    nnodes, nproc_per_node). More micro-batches (time only), the backbone sharded over the
    seat's ranks, twice then four times the ranks per seat (sharded), then shorter targets; each
    with the fewest micro-batches the seat group can share. ``resident_fits``: what the job
    holds but its activations fits the device, so fewer activations alone may do."""
    cfg = config_file.load(TrainConfig, argv)
    n, world = cfg.n_nodes(), nnodes * per_node
    k = world // n if world >= n else 1

    def micro(ks: int) -> List[int]:   # micro_batches a seat of ks ranks can share, up to batch_size
        doubled = (cfg.micro_batches * 2 ** i for i in range(8))
        return [m for m in doubled if m <= cfg.batch_size and m % ks == 0]

    out = []
    if resident_fits:
        out += [(f"micro_batches={m}", argv + [f"micro_batches={m}"], nnodes, per_node)
                for m in micro(k) if m > cfg.micro_batches]
    grown = [(k, nnodes)] if k > 1 and not cfg.shard_backbone else []
    grown += [(k * f, nnodes * f) for f in (2, 4) if world >= n]
    for ks, nn in grown:
        for m in micro(ks):
            more = f", {ks} ranks per seat (--nnodes {nn})" if nn != nnodes else ""
            out.append((f"shard_backbone=true, micro_batches={m}{more}",
                        argv + ["shard_backbone=true", f"micro_batches={m}"], nn, per_node))
    for t in (cfg.max_target_tokens // 2, cfg.max_target_tokens // 4):
        if t >= 1:
            m = (micro(k) or [cfg.micro_batches])[-1]
            out.append((f"max_target_tokens={t}, micro_batches={m}",
                        argv + [f"max_target_tokens={t}", f"micro_batches={m}"], nnodes, per_node))
    return out


def find_fix(argv: List[str], nnodes: int, per_node: int, device_memory: int, plans: Sequence[dict],
             pool: Optional[concurrent.futures.Executor] = None, device: str = "cuda",
             log: Log = lambda line: None) -> Optional[Dict[str, object]]:
    """The first change of :func:`changes` that fits, each rehearsed (``log`` is told each try):
    {change, argv, nnodes, nproc_per_node, peak, launch}; None when none does."""
    resident_fits = all(p["peak"] - p["memory"]["activations"] <= HEADROOM * device_memory for p in plans)
    for what, new, n, p in changes(argv, nnodes, per_node, resident_fits):
        log(f"rehearsing: {what} ...")
        try:
            tried = rehearse_job(new, n, p, device_memory, pool, device)
        except Exception as e:   # a change the trainer refuses (e.g. sharding while collecting)
            log(f"  refused: {str(e).splitlines()[0][:200]}")
            continue
        peak = max(q["peak"] for q in tried)
        log(f"  peak {size_text(peak)}: {'fits' if fits(tried, device_memory) else 'does not fit'}")
        if fits(tried, device_memory):
            launch = f"torchrun --nnodes {n} --nproc_per_node {p} -m admm_dist.train " + " ".join(new)
            return {"change": what, "argv": new, "nnodes": n, "nproc_per_node": p, "peak": peak,
                    "launch": launch}
    return None


def workers() -> concurrent.futures.Executor:
    """Two worker processes for the rehearsals of a search, forked from this process's fork
    server (:mod:`admm_dist.training.workers`): a fresh interpreter, so no fake world is
    inherited, which imports torch and transformers once for both (and for every later search of
    this process), not once each."""
    return concurrent.futures.ProcessPoolExecutor(max_workers=2, mp_context=forkserver.context(),
                                                  initializer=forkserver.adopt,
                                                  initargs=(forkserver.caller_state(),))


def planned_device(cfg: TrainConfig, local_rank: int) -> Tuple[str, Optional[int]]:
    """The device type the job runs on (``device``; auto: CUDA where present) and the memory it may
    plan for: ``device_memory`` when set, else a visible CUDA device's own, read from its properties
    (no memory is taken on it), else None: a CPU job, or a CUDA job on a machine without CUDA
    (the device is refused after the plan, where the process group is set up)."""
    import torch

    kind = device_type(cfg.device)
    if cfg.device_memory is not None:
        return kind, parse_size(cfg.device_memory)
    if kind == "cuda" and torch.cuda.is_available():
        index = int(cfg.device.split(":")[1]) if ":" in cfg.device else local_rank
        if index < torch.cuda.device_count():
            return kind, torch.cuda.get_device_properties(index).total_memory
    return kind, None


def check_before_loading(cfg: TrainConfig, argv: List[str], env: DistEnv, log: Log) -> None:
    """This rank of the job rehearsed, on its device's type, before any weights are read or any
    device memory is taken; a rank that will not fit raises :class:`UserError`, one line naming the
    change that fits (rehearsed). Each rank that does not fit finds the same change (the search is
    deterministic), so the job says it once whichever rank says it first."""
    if not cfg.plan_memory:
        return
    device, budget = planned_device(cfg, env.local_rank)
    if budget is None:
        return
    from transformers import AutoConfig

    from admm_dist.training.rehearsal import rehearse

    try:
        AutoConfig.from_pretrained(cfg.model_name)
    except Exception:   # no backbone there to plan for: the loader says so, in its own words
        return
    per_node = env.per_node
    if env.world_size % per_node:
        per_node = env.world_size
    try:
        plan = rehearse(cfg, env.world_size, env.rank, per_node=per_node, device=device,
                        device_memory=budget).to_dict()
    except UserError:
        raise                     # what the trainer itself would refuse
    except Exception as e:        # a backbone or op fake tensors cannot run: the check is advice only
        if env.rank == 0:
            why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
            log(f"memory plan: could not rehearse this job ({why}); going on without it "
                "(plan_memory=false skips the attempt)")
        return
    # the same words on every rank of a kind, so that the job says it once
    where = f"its {plan['kind']} ranks need {size_text(plan['peak'])} of {size_text(budget)} x {HEADROOM:.0%}"
    if fits([plan], budget):
        if env.rank == 0:
            log(f"memory plan: rank 0 ({plan['kind']}) needs {size_text(plan['peak'])} of "
                f"{size_text(budget)} x {HEADROOM:.0%}, rehearsed in {plan['seconds']:.1f}s "
                "(plan_memory=false skips it)")
        return
    pool = workers()
    try:
        fix = find_fix(argv, env.world_size // per_node, per_node, budget, [plan], pool, device)
    finally:
        pool.shutdown(cancel_futures=True)
    change = (f"{fix['change']} fits ({size_text(fix['peak'])}, rehearsed): {fix['launch']}" if fix else
              "no change tried fits (use devices with more memory or a smaller backbone)")
    raise UserError(f"this job will not fit its devices: {where}; {change}; python -m admm_dist.plan "
                    "shows the plan, plan_memory=false skips this check")
