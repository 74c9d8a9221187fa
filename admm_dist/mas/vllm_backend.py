"""A vLLM rollout backend: the same ``generate`` contract as :mod:`admm_dist.mas.generate`.

Design
------
One :class:`VLLMBackend` owns one ``vllm.LLM`` engine that holds the *frozen* backbone
(``model_path``). The trainable part of a seat, its flat B vector (:mod:`admm_dist.model.adapter`),
reaches the engine as a LoRA adapter exported into the backend's work folder, one per
distinct state, in a bounded cache (:mod:`admm_dist.mas.vllm_lora`): a state that changed is
a new adapter, loaded without restarting the engine. ``state=None`` runs the base model (the
adapter off), as ``BOnlyLoRA.disabled()`` does. The work folder is the caller's
(``workdir=``) or, by default, a temporary folder of the backend's own, removed by
:meth:`VLLMBackend.close` and when construction fails.

Inputs and outputs match the HF backend row for row. Prompts are chat-formatted text; they
are tokenized here with ``tokenizer(p, add_special_tokens=False)`` and passed as token ids
(``TokensPrompt``), so the engine sees exactly the ids the HF backend sees; vLLM's own
tokenizer is never loaded (``skip_tokenizer_init``, ``detokenize=False``). The new ids are
cut at the first end-of-turn id (the ids of ``generate.stop_ids``: the tokenizer's eos,
the generation config's eos, ``<|im_end|>``), decoded with the same tokenizer and
``skip_special_tokens=False``; ``finished`` means it stopped on such an id and ``n_tokens =
len(tokens) + finished``. ``max_new_tokens <= 0`` returns empty generations without calling
the engine. Sampling maps one to one: ``temperature``, ``top_p``, ``max_tokens``,
``stop_token_ids``; rows whose seed is None are greedy (temperature 0).

Seeds and reproducibility. Every sampled row passes its own seed
(``SamplingParams(seed=row_seed mod 2**63)``): vLLM gives each such request its own
``torch.Generator``, so a row's draw does not depend on its batch mates or its position, and
the same seeds give the same samples run after run. vLLM's sampler is not the HF backend's
Gumbel processor, so the two backends draw *different* samples from the same distribution.
On CPU the engine runs with chunked prefill off: vLLM 0.32 rewinds a seeded request's
generator after a partial-prefill step (``gen.set_offset``), which CPU generators refuse
("CPU Generator does not use offset", and the engine dies) -- that, not seeding itself, is
what breaks per-request seeds on CPU. Without per-request seeds (the engine-wide ``seed``
alone) CPU sampling was not even repeatable across runs. On CUDA, batched bf16 kernels are
not batch-invariant, so a near-tie may still resolve differently in another batch.

Log-probabilities. vLLM's default ``logprobs_mode="raw_logprobs"`` is log-softmax of the
model's logits before temperature/top-p (what the HF model gives): ``generate(...,
return_logprobs=True)`` keeps the sampled tokens' raw log-probs in ``last_logprobs``
(one list per row, the stop token included), and :meth:`logprobs_of` teacher-forces given
completions and reads vLLM's ``prompt_logprobs`` (log p of each given token).

Running inside a torchrun rank. vLLM starts an engine-core process and a worker process
(spawn; the calling script needs an ``if __name__ == "__main__":`` guard). On CPU they form
their own one-process gloo group through a file store, so the trainer's process group and
``MASTER_PORT`` are not touched (a 2-rank torchrun with torchrun's variables left visible
worked too). What does clash: while the engine is built, vLLM edits the caller's
``os.environ`` -- ``LOCAL_WORLD_SIZE`` becomes 1 (torchrun's value is lost), ``LD_PRELOAD``
gains libgomp (and libtcmalloc where bundled), plus ``VLLM_WORKER_MULTIPROC_METHOD`` and a
few more, which every later subprocess of the trainer would inherit. The backend therefore
builds the engine with torchrun's variables hidden (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ...: vLLM's processes never see the trainer's job) and then restores the
whole environment and the torch thread count. vLLM's automatic CPU binding puts the worker
of every engine on the same core(s); with several local ranks (``LOCAL_WORLD_SIZE > 1``) and
no ``VLLM_CPU_OMP_THREADS_BIND`` set, rank k's engine is bound to the k-th share of the
allowed cores instead. On CUDA the worker is pinned to the rank's current device through
``CUDA_VISIBLE_DEVICES`` (vLLM's worker would otherwise take device 0), and
``gpu_memory_utilization`` is the share of that GPU the engine may take (the trainer's
backbone shares it); this CUDA path is not exercised by the CPU tests.

Precision. ``dtype="auto"`` is *the checkpoint's dtype* (vLLM's own "auto" would run an fp32
checkpoint in bf16); a run's float32 or bfloat16 is passed through. vLLM keeps LoRA weights in
the model dtype, where the HF adapter keeps A and B in fp32: expect bf16-level differences on a
bf16 backbone, fp32-level (~1e-5 in log-probs) on an fp32 one.

Other vLLM 0.32 limits met here: ``max_lora_rank`` must be one of 1, 8, 16, 32, 64, 128,
256, 320, 512 (the adapter's rank is rounded up); LoRA is enabled only on the adapter's
projections (``lora_target_modules``), because vLLM's LoRA wrapper of the LM head breaks
``prompt_logprobs`` (an einsum shape error kills the engine).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import types
from typing import Iterator, List, Optional, Sequence

import torch

from admm_dist.core.errors import UserError
from admm_dist.core.libraries import vllm_installed
from admm_dist.mas.generate import Generation, stop_ids
from admm_dist.mas.vllm_lora import MAX_STATES, LoRAStates

INSTALL_HINT = ("generation_backend=vllm needs vLLM: with a GPU `bash launch/install.sh vllm`; on CPU "
                "`bash launch/vllm_env.sh`, then run with .venv-vllm/bin/python (docs/vllm.md)")
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)   # vllm.config.lora.MaxLoRARanks (0.32)
SEED_MOD = 1 << 63               # vLLM keeps request seeds in int64
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING")


class VLLMBackendError(UserError):
    """The vLLM backend cannot start or run (vLLM missing, a model or setting it cannot serve);
    the message says what to change."""


def require_vllm() -> None:
    """Fail before any weights load when vLLM is missing (a broken install fails at engine start)."""
    if not vllm_installed():
        raise VLLMBackendError(f"{INSTALL_HINT} (vLLM is not installed in this environment)")


def _import_vllm():
    try:
        import vllm  # noqa: F401
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest
        from vllm.platforms import current_platform
    except ImportError as exc:
        raise VLLMBackendError(f"{INSTALL_HINT} ({type(exc).__name__}: {exc})") from None
    return types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams, TokensPrompt=TokensPrompt,
                                 LoRARequest=LoRARequest, platform=current_platform,
                                 version=getattr(vllm, "__version__", "?"))


def lora_rank_for(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of rank ``rank``."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise VLLMBackendError(f"lora_rank={rank} is above vLLM's largest max_lora_rank "
                           f"{VLLM_LORA_RANKS[-1]}: use a smaller lora_rank")


def _read_config(model_path: str) -> dict:
    """The model's (text) config as a dict: from a local folder, or a hub id in the local cache."""
    path = os.path.join(model_path, "config.json")
    if os.path.isdir(model_path):
        if not os.path.isfile(path):
            raise VLLMBackendError(f"{model_path} holds no model (config.json missing): pass a "
                                   f"transformers model folder (safetensors + config.json)")
        with open(path) as fh:
            cfg = json.load(fh)
    else:
        try:
            from transformers import AutoConfig
            cfg = AutoConfig.from_pretrained(model_path).to_dict()
        except Exception as exc:   # OSError, ValueError, hub errors
            raise VLLMBackendError(f"model {model_path!r} is neither a local folder nor a model id whose "
                                   f"config can be read ({type(exc).__name__}): pass the backbone's "
                                   f"folder") from None
    return cfg


def _text(cfg: dict) -> dict:
    text = cfg.get("text_config")
    return text if isinstance(text, dict) else cfg


def _checkpoint_dtype(cfg: dict) -> Optional[str]:
    for c in (cfg, _text(cfg)):
        d = str(c.get("dtype") or c.get("torch_dtype") or "").replace("torch.", "")
        if d in ("float32", "bfloat16", "float16"):
            return d
    return None


def _physical_cuda_device(index: int) -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [x.strip() for x in visible.split(",") if x.strip()]
        if index < len(ids):
            return ids[index]
    return str(index)


def _cpu_share(local_rank: int, local_world: int) -> Optional[str]:
    """Rank ``local_rank``'s share of the allowed cores, as a VLLM_CPU_OMP_THREADS_BIND list."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    if local_world <= 1 or not 0 <= local_rank < local_world or len(cpus) < local_world:
        return None
    per = len(cpus) // local_world
    mine = cpus[local_rank * per:(local_rank + 1) * per]
    return ",".join(str(c) for c in mine)


class _DropChatWarmup(logging.Filter):
    """vLLM warms up a chat template with its own tokenizer, which this backend never loads
    (``skip_tokenizer_init``); the failed warm-up is logged as a warning with a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Chat template warmup failed")


@contextlib.contextmanager
def _engine_env(on_cpu: bool) -> Iterator[None]:
    """Build the engine with torchrun's variables hidden; restore os.environ afterwards."""
    saved = dict(os.environ)
    threads = torch.get_num_threads()
    local_rank = int(saved.get("LOCAL_RANK", "0") or 0)
    local_world = int(saved.get("LOCAL_WORLD_SIZE", "1") or 1)
    quiet = logging.getLogger("vllm.renderers.base")
    drop = _DropChatWarmup()
    try:
        for k in TORCHRUN_VARS:
            os.environ.pop(k, None)
        if on_cpu:
            if "VLLM_CPU_OMP_THREADS_BIND" not in saved:
                share = _cpu_share(local_rank, local_world)
                if share:
                    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = share
                    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        elif torch.cuda.is_available():
            idx = torch.cuda.current_device() if torch.cuda.is_initialized() else (
                local_rank if "LOCAL_RANK" in saved else None)
            if idx is not None and idx < torch.cuda.device_count():
                os.environ["CUDA_VISIBLE_DEVICES"] = _physical_cuda_device(idx)
        quiet.addFilter(drop)          # a filter: vLLM's dictConfig resets the logger's level
        yield
    finally:
        quiet.removeFilter(drop)
        os.environ.clear()
        os.environ.update(saved)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


class VLLMBackend:
    """Rollouts on a vLLM engine; seat states are B vectors turned into LoRA adapters.

    ``tokenizer`` is the HF tokenizer the HF backend uses (prompts are tokenized and outputs
    decoded with it). ``adapter`` (a :class:`~admm_dist.model.adapter.BOnlyLoRA`) is needed for any
    ``state``; it only exports PEFT folders, its own vector is left unchanged. ``workdir``
    holds the exported adapters (give every rank its own); None (the default): a temporary
    folder the backend makes and removes in :meth:`close`, or at once if construction fails.
    ``kv_cache_gib`` sizes the KV cache on CPU; on GPU vLLM sizes it within
    ``gpu_memory_utilization`` of the device.
    """

    def __init__(self, model_path: str, tokenizer, adapter=None, *, workdir: Optional[str] = None,
                 seed: int = 0, max_model_len: int = 4096, dtype: str = "auto", kv_cache_gib: float = 1.0,
                 max_lora_rank: Optional[int] = None, gpu_memory_utilization: float = 0.5):
        self._v = _import_vllm()
        self._own_workdir = workdir is None
        self.workdir = (tempfile.mkdtemp(prefix="admm_dist-vllm-") if workdir is None
                        else os.path.abspath(workdir))
        try:
            os.makedirs(self.workdir, exist_ok=True)
            self._start(model_path, tokenizer, adapter, seed, max_model_len, dtype, kv_cache_gib,
                        max_lora_rank, gpu_memory_utilization)
        except BaseException:
            self.close()   # the engine's processes, if any, and a work folder of our own
            raise

    def _start(self, model_path, tokenizer, adapter, seed, max_model_len, dtype, kv_cache_gib,
               max_lora_rank, gpu_memory_utilization) -> None:
        self.model_path = os.path.abspath(model_path) if os.path.isdir(model_path) else str(model_path)
        cfg = _read_config(self.model_path)
        self.tok = tokenizer
        self.adapter = adapter
        self.on_cpu = bool(self._v.platform.is_cpu())
        self.seed = int(seed)
        if max_model_len < 2:
            raise VLLMBackendError(f"max_model_len={max_model_len} must be >= 2")
        native = _text(cfg).get("max_position_embeddings")
        self.max_model_len = int(min(max_model_len, native) if isinstance(native, int) and native > 0
                                 else max_model_len)
        if dtype == "auto":
            dtype = _checkpoint_dtype(cfg) or "auto"
        self.dtype = dtype
        self.stop_ids: List[int] = stop_ids(tokenizer, types.SimpleNamespace(
            generation_config=self._generation_config()))
        self._stop = set(self.stop_ids)
        self._states = LoRAStates(adapter, self.workdir, self._v.LoRARequest,
                                  remove=lambda int_id: self.llm.llm_engine.remove_lora(int_id))
        self.last_token_ids: List[List[int]] = []
        self.last_logprobs: List[List[float]] = []

        kw = dict(seed=self.seed, dtype=dtype, max_model_len=self.max_model_len,
                  skip_tokenizer_init=True, enforce_eager=self.on_cpu,
                  gpu_memory_utilization=float(gpu_memory_utilization))
        if self.on_cpu:
            # chunked prefill off: per-request seeds on CPU need it (module docstring)
            kw.update(kv_cache_memory_bytes=int(float(kv_cache_gib) * (1 << 30)),
                      enable_chunked_prefill=False)
        if adapter is not None:
            rank = int(adapter.config.lora_rank)
            want = rank if max_lora_rank is None else int(max_lora_rank)
            if want < rank:
                raise VLLMBackendError(f"max_lora_rank={max_lora_rank} is below the adapter's "
                                       f"lora_rank={rank}: leave it unset or raise it")
            self.max_lora_rank = lora_rank_for(want)
            # lora_target_modules: only the adapter's projections get LoRA slots (module docstring)
            kw.update(enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=1,
                      max_cpu_loras=MAX_STATES,
                      lora_target_modules=list(adapter.config.target_modules))
        else:
            self.max_lora_rank = None
        try:
            with _engine_env(self.on_cpu):
                self.llm = self._v.LLM(self.model_path, **kw)
        except Exception as exc:   # vLLM raises many types; keep the cause, name the model
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            raise VLLMBackendError(f"vLLM {self._v.version} could not start an engine on "
                                   f"{self.model_path} ({type(exc).__name__}: {first}): check that "
                                   f"vLLM supports this architecture and dtype={dtype}, and that "
                                   f"max_model_len={self.max_model_len} and the KV cache fit") from exc

    # ------------------------------------------------------------------ helpers
    def _generation_config(self):
        try:
            from transformers import GenerationConfig
            return GenerationConfig.from_pretrained(self.model_path)
        except (OSError, ValueError):
            return None

    def _check_open(self) -> None:
        if getattr(self, "llm", None) is None:
            raise VLLMBackendError("this VLLMBackend is closed: build a new one")

    def _encode(self, prompts: Sequence[str]) -> List[List[int]]:
        return [list(self.tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]

    def _lora_for(self, state: Optional[torch.Tensor]):
        if state is None:
            return None
        if self.adapter is None:
            raise VLLMBackendError("a seat state needs the adapter: build VLLMBackend(..., adapter=...)")
        if not isinstance(state, torch.Tensor) or state.numel() != self.adapter.numel:
            got = state.numel() if isinstance(state, torch.Tensor) else type(state).__name__
            raise VLLMBackendError(f"state has {got} values but the adapter has P={self.adapter.numel} "
                                   f"B entries: pass the seat's flat B vector")
        return self._states.request(state)

    def _run(self, prompts, params, lora):
        try:
            return self.llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        except Exception as exc:
            if type(exc).__name__ != "EngineDeadError":
                raise
            raise VLLMBackendError("the vLLM engine died (its processes logged the cause above): "
                                   "close this backend and build a new one") from exc

    def _budget(self, ids: List[int], want: int, row: int) -> int:
        room = self.max_model_len - len(ids)
        if room < 1:
            raise VLLMBackendError(f"row {row}: the prompt has {len(ids)} tokens, max_model_len="
                                   f"{self.max_model_len} leaves no room to generate: raise "
                                   f"max_model_len or clip the context (context_tokens)")
        return min(want, room)

    # ------------------------------------------------------------------ API
    def generate(self, prompts: Sequence[str], *, seeds: Sequence[Optional[int]], max_new_tokens: int,
                 temperature: float, top_p: float, state: Optional[torch.Tensor] = None,
                 return_logprobs: bool = False) -> List[Generation]:
        """One completion per prompt, as :func:`admm_dist.mas.generate.generate`.

        ``return_logprobs`` also keeps the generated tokens' raw log-probs (before temperature
        and top-p) in ``self.last_logprobs``; ``self.last_token_ids`` always holds the
        generated ids (the stop token included).
        """
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        self._check_open()
        self.last_token_ids, self.last_logprobs = [], []
        if max_new_tokens <= 0 or not prompts:
            return [Generation("", False, 0) for _ in prompts]
        if any(s is not None for s in seeds):
            if temperature <= 0:
                raise ValueError("temperature must be > 0 for sampling; use seed=None rows for greedy")
            if not 0 < top_p <= 1:
                raise ValueError(f"top_p={top_p} must be in (0, 1]")
        lora = self._lora_for(state)
        ids = self._encode(prompts)
        params = []
        for r, (row, s) in enumerate(zip(ids, seeds)):
            kw = dict(max_tokens=self._budget(row, int(max_new_tokens), r), stop_token_ids=self.stop_ids,
                      detokenize=False, logprobs=0 if return_logprobs else None)
            if s is None:
                kw.update(temperature=0.0)
            else:
                kw.update(temperature=float(temperature), top_p=float(top_p), seed=int(s) % SEED_MOD)
            params.append(self._v.SamplingParams(**kw))
        outs = self._run([self._v.TokensPrompt(prompt_token_ids=row) for row in ids], params, lora)
        gens: List[Generation] = []
        for out in outs:
            o = out.outputs[0]
            new = list(o.token_ids)
            cut = next((j for j, t in enumerate(new) if t in self._stop), None)
            toks = new if cut is None else new[:cut]
            gens.append(Generation(self.tok.decode(toks, skip_special_tokens=False), cut is not None,
                                   len(toks) + (cut is not None)))
            self.last_token_ids.append(new)
            if return_logprobs:
                lps = o.logprobs or []
                self.last_logprobs.append([float(d[t].logprob) for t, d in zip(new, lps)])
        return gens

    def logprobs_of(self, prompts: Sequence[str], completions_token_ids: Sequence[Sequence[int]],
                    state: Optional[torch.Tensor] = None) -> List[List[float]]:
        """log p(token | prompt, earlier tokens) of each given completion token (teacher-forced,
        from vLLM's ``prompt_logprobs``): the engine's view of a rollout, for checks."""
        if len(completions_token_ids) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(completions_token_ids)} completions")
        self._check_open()
        lora = self._lora_for(state)
        ids = self._encode(prompts)
        rows, todo = [], []
        for r, (p, c) in enumerate(zip(ids, completions_token_ids)):
            if not p:
                raise VLLMBackendError(f"row {r}: an empty prompt has no context to score from")
            full = p + [int(t) for t in c]
            if len(full) >= self.max_model_len:
                raise VLLMBackendError(f"row {r}: prompt + completion is {len(full)} tokens, not below "
                                       f"max_model_len={self.max_model_len}")
            rows.append(full)
            if c:
                todo.append(r)
        result: List[List[float]] = [[] for _ in prompts]
        if not todo:
            return result
        sp = self._v.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outs = self._run([self._v.TokensPrompt(prompt_token_ids=rows[r]) for r in todo], sp, lora)
        for r, out in zip(todo, outs):
            n_prompt = len(ids[r])
            plps = out.prompt_logprobs
            result[r] = [float(plps[j][rows[r][j]].logprob) for j in range(n_prompt, len(rows[r]))]
        return result

    def close(self) -> None:
        """Stop the engine's processes and delete the exported adapters (and the work folder
        when the backend made it). Safe to call again, and on a half-built backend."""
        llm = getattr(self, "llm", None)
        self.llm = None
        states = getattr(self, "_states", None)
        if states is not None:
            states.clear()
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
        if getattr(self, "_own_workdir", False):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "VLLMBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
