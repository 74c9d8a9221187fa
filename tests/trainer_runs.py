"""The tiny trainer run the trainer's tests start from: a random 2-layer Qwen3 (built offline)
with N = 3 seats and a synthetic DPO fit set (``assets``, one per test module), as a config
(``_cfg``), as command-line overrides (``_args``), in one rank (``_train_worker``; several runs
one after the other in one launch: ``_train_many``) or under torchrun's elastic agent
(``_launch_cli``); and the stand-in's on-policy run (``standin_cfg``: the shipped stand-in's
4-seat chain collecting its own fit sets)."""
import pytest

from admm_dist.bench.launcher import launch_cpu
import faults
from admm_dist.training.config import TrainConfig
from admm_dist.training.trainer import Trainer

from conftest import build_tiny, cli_rank, tiny_settings

N = 3


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("assets"), N)


def _settings(assets, out, **kw):
    """The tiny run every test starts from, as {key: value}."""
    return tiny_settings(assets, **dict(dict(k_outer=3, local_steps=3, out=str(out / "run"),
                                             report_dir=str(out / "reports"), quiet=True, timeout_s=60), **kw))


def _cfg(assets, out, **kw):
    return TrainConfig(**_settings(assets, out, **kw))


def standin_cfg(tmp, **kw):
    """A short on-policy run of the shipped stand-in (``assets/standin``): 4 seats, 6 queries x 4
    branches per seat (``per_role``), DPO, 2 rounds; ``kw`` overrides."""
    from admm_dist.demo import standin

    base = dict(task="chain_arith", anchor_split="train", model_name=str(standin.DEFAULT_DIR), device="cpu",
                n_agents=4, anchors=6, group=4, credit="per_role", fit_mode="dpo", max_new_tokens=16,
                gen_batch_size=256, gen_chunk=16, lora_rank=4, lora_alpha=8.0, lora_layers_last=2,
                k_outer=2, local_steps=2, batch_size=4, eta=0.003, rho=0.1, grad_clip=1.0,
                empty_nodes="prox", out=str(tmp / "run"), report_dir=str(tmp / "rep"), quiet=True,
                timeout_s=120)
    base.update(kw)
    return TrainConfig(**base)


def _train_worker(ctx, cfg):
    faults.install(faults.from_env())     # ADMM_DIST_FAULT_AT's plan, armed in this rank
    report = Trainer(cfg, ctx).train()
    return report["loss_curve"]


def _train_many(ctx, cfgs):
    """Train every config of ``cfgs`` in turn on the same ranks (one launch, one process group,
    the ranks' start-up paid once): what several launches of :func:`_train_worker` would do, a
    second or two cheaper a run. Their loss curves, in order."""
    return [_train_worker(ctx, cfg) for cfg in cfgs]


def _args(assets, out, **kw):
    """The same run as command-line overrides (k=v), shorter rounds for the CLI tests."""
    d = _settings(assets, out, **dict(dict(k_outer=4, local_steps=2, timeout_s=30), **kw))
    return [f"{k}={v}" for k, v in d.items()]


def _launch_cli(args, nproc, monkeypatch, restarts=0, fault=None):
    """The training command on ``nproc`` ranks under torchrun's elastic agent (in-process, from a
    fork server: no interpreter start-up per rank); ``fault`` plans one (tests.faults), which
    :func:`conftest.cli_rank` arms in each rank."""
    monkeypatch.delenv(faults.ENV, raising=False)
    if fault:
        monkeypatch.setenv(faults.ENV, fault)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return launch_cpu(cli_rank, nproc, args, timeout_s=120, max_restarts=restarts, setup=False)
