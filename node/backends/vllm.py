"""``vllm`` backend: a vLLM ``LLM`` engine on a CUDA host, weights swapped without restart.

vLLM is imported inside :class:`VLLMBackend` only, so this module loads anywhere; building the
backend on a machine without CUDA or vLLM raises :class:`BackendUnavailable` in one line. The
``[vllm]`` extra pins vLLM 0.33.0 (docs/backends.md).

- sampling rule: every token is ``policy.draw.draw_tokens`` at the sample's seeded uniform,
  drawn by :class:`node.backends.vllm_sampler.SeededInverseCDFProcessor` (a Model Runner V2
  logits processor loaded with ``LLM(logits_processors=[...])``); the behaviour log-probs are the
  processor's, read back from the workers with ``collective_rpc``, and vLLM's tokens must agree
  with them token for token. :attr:`sampling_rule` stays None (a node refuses the backend)
  unless ``ROLLOUT_SWARM_VLLM_SEEDED_DRAWS=1``: the path has not yet run on a GPU
  (bench/vllm_gpu.sh is the check). Without the processor (older vLLM) the engine samples with
  its own sampler and ``logprobs_mode="processed_logprobs"`` (local benchmarks only).
- seeds: each sample is its own vLLM request with ``n=1`` (prefix caching shares the prompt's
  KV across the group), so samples do not depend on ``n``.
- EOS: the engine runs with ``skip_tokenizer_init=True`` (token ids in, token ids out), where
  vLLM does not know the EOS id, so EOS ids are always passed as ``stop_token_ids``; vLLM keeps
  the stop token in ``token_ids``.
- weights: :meth:`load_state_dict` streams the checkpoint (only the ``changed`` tensors when
  given) in chunks staged as safetensors files (``/dev/shm`` when it has room, else the disk)
  into every worker's ``model.load_weights`` one tensor at a time, between two checked
  prefix-cache resets (:mod:`node.backends.vllm_weights`). Generation and updates never overlap.
  Unquantized models only.
- LoRA versions (docs/protocol.md §8.6), with ``max_lora_rank`` set (``vllm_max_lora_rank`` in
  node.toml for a node started by ``swarm node run``; ``max_loras`` is its ``keep_versions``): the
  engine starts with ``enable_lora=True`` over the base model; each version's adapter is written
  once as a peft-format directory (``adapter_config.json`` + ``adapter_model.safetensors``) that
  each request names with a ``vllm.lora.request.LoRARequest`` (imported lazily); vLLM keeps the
  last ``max_loras`` adapters (``max_cpu_loras``, S + 1) and switches per request, never
  reloading the base. Tested under the ``gpu`` marker only.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import os
import tempfile
import threading
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from node.backends import vllm_sampler
from node.backends.base import (
    BackendError,
    BackendUnavailable,
    GenerationRequest,
    InferenceBackend,
    SampleOut,
    SamplingConfig,
    sample_seed,
)
from node.backends.vllm_sampler import FQCN as DRAW_PROCESSOR
from node.backends.vllm_sampler import extra_args
from node.backends.vllm_weights import (
    DEFAULT_CHUNK_BYTES,
    UpdateStats,
    reset_prefix_cache_checked,
    staging_candidates,
    staging_need,
    stream_update,
    worker_load_file,
)
from node.backends.vllm_weights import staging_dir as pick_staging_dir
from policy.draw import SAMPLING_RULE
from policy.model import ModelSpec

log = logging.getLogger(__name__)

INSTALL_HINT = "install 'rollout-swarm[vllm]' on a CUDA host"
#: set to 1 to declare the seeded draws as the swarm's sampling rule (a node then runs this
#: backend); off by default until a GPU run has shown the coordinator's replay accepts them
SEEDED_TRIAL_ENV = "ROLLOUT_SWARM_VLLM_SEEDED_DRAWS"


class VLLMBackend(InferenceBackend):
    """vLLM engine wrapper (see module docstring)."""

    name = "vllm"
    #: vLLM's own sampler, not policy.draw.draw_tokens yet (see the module docstring)
    sampling_rule: str | None = None

    def __init__(
        self,
        spec: ModelSpec | None = None,
        *,
        device: str = "auto",
        gpu_memory_utilization: float = 0.85,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        staging_dir: str | None = None,
        update_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        reset_timeout_s: float = 10.0,
        max_lora_rank: int | None = None,
        max_loras: int = 5,
        **engine_kwargs: Any,
    ) -> None:
        """``max_lora_rank``: start the engine for LoRA versions up to this rank (None: full
        versions only; vLLM reserves adapter memory at start; a node's ``vllm_max_lora_rank``);
        ``max_loras``: adapters held (S + 1, a node's ``keep_versions``)."""
        self._configure(spec, staging_dir, update_chunk_bytes, reset_timeout_s)
        self.max_lora_rank = max_lora_rank
        self.max_loras = max(1, max_loras)
        if device not in ("auto", "cuda") and not device.startswith("cuda"):
            raise BackendUnavailable(f"the vllm backend runs on CUDA only (device={device!r})")
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - torch is a core dependency
            raise BackendUnavailable(f"vllm backend needs torch: {INSTALL_HINT}") from exc
        if not torch.cuda.is_available():
            raise BackendUnavailable(f"vllm backend needs a CUDA GPU (none found): {INSTALL_HINT}")
        try:
            import vllm
            from vllm import LLM
        except ImportError as exc:
            raise BackendUnavailable(f"vllm is not importable ({exc}): {INSTALL_HINT}") from exc

        self._vllm_version = str(getattr(vllm, "__version__", "unknown"))
        model_dir = self._model_dir()
        cfg = _read_config(model_dir)
        self.vocab_size = int(cfg["vocab_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
        gen_cfg = model_dir / "generation_config.json"
        if gen_cfg.is_file():
            g = _read_json(gen_cfg).get("eos_token_id")
            eos_ids += g if isinstance(g, list) else [g] if isinstance(g, int) else []
        if not eos_ids:
            raise BackendError(f"{model_dir}/config.json has no eos_token_id; set it")
        self.eos_token_ids = tuple(sorted({int(e) for e in eos_ids}))
        self.dtype = self.spec.dtype
        self.loaded_version = None

        kwargs: dict[str, Any] = dict(
            model=str(model_dir),
            dtype=self.spec.dtype,
            skip_tokenizer_init=True,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            enable_prefix_caching=True,
            seed=0,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        self.processed_logprobs = _engine_supports("logprobs_mode")
        if self.processed_logprobs:
            kwargs["logprobs_mode"] = "processed_logprobs"
        else:
            log.warning(
                "vLLM %s has no logprobs_mode: only plain sampling (T=1, top_p=1, top_k=0) "
                "is allowed",
                self._vllm_version,
            )
        # weight loading runs in the workers; a worker extension keeps it a plain method call
        # (a pickled callable would need VLLM_ALLOW_INSECURE_SERIALIZATION=1 on vLLM V1)
        self._extension = _engine_supports("worker_extension_cls")
        if self._extension:
            kwargs["worker_extension_cls"] = f"{__name__}.{VLLMWorkerExtension.__name__}"
        # the swarm's seeded inverse-CDF draw runs as a Model Runner V2 logits processor
        self.seeded_draws = (
            self._extension
            and _engine_supports("logits_processors")
            and hasattr(vllm_sampler, "SeededInverseCDFProcessor")
        )
        if self.seeded_draws:
            kwargs["logits_processors"] = [DRAW_PROCESSOR]
        if max_lora_rank is not None:
            kwargs.update(
                enable_lora=True,
                max_lora_rank=max_lora_rank,
                max_loras=self.max_loras,
                max_cpu_loras=self.max_loras,
            )
        kwargs.update(engine_kwargs)
        try:
            self._llm = LLM(**kwargs)
        except Exception as exc:
            raise BackendError(f"vLLM could not start on {model_dir}: {exc}") from exc
        from vllm import SamplingParams

        self._adopt_engine(self._llm, SamplingParams)
        if self.seeded_draws and os.environ.get(SEEDED_TRIAL_ENV) == "1":
            # opt-in until bench/vllm_gpu.sh has shown the coordinator accepts these draws
            self.sampling_rule = SAMPLING_RULE

    def _configure(
        self,
        spec: ModelSpec | None,
        staging_dir: str | None,
        update_chunk_bytes: int,
        reset_timeout_s: float,
    ) -> None:
        """The engine-independent options (documented on :class:`VLLMBackend`)."""
        self.spec = spec or ModelSpec()
        #: where weight chunks are staged (None: $ROLLOUT_SWARM_STAGING_DIR, /dev/shm, /tmp).
        self.staging_dir = staging_dir
        #: upper bound of one staged chunk of a weight update (bytes).
        self.update_chunk_bytes = update_chunk_bytes
        #: bounded wait for reset_prefix_cache() to succeed before a version is refused (s).
        self.reset_timeout_s = reset_timeout_s
        self.last_update: UpdateStats | None = None
        self._lock = threading.Lock()  # generate and weight updates never overlap
        self._tags = itertools.count()
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._vllm_version = "unknown"
        #: LoRA version -> its vLLM request (adapter directory on disk), oldest first
        self._loras: dict[int, Any] = {}
        self._lora_dirs: tempfile.TemporaryDirectory[str] | None = None
        self._lora_base: str | None = None
        #: highest adapter rank the engine was started for (None: no LoRA versions)
        self.max_lora_rank = None
        self.max_loras = 5

    def _adopt_engine(self, llm: Any, sampling_params_cls: Any) -> None:
        """Check and keep a started ``LLM`` (the tests hand in a fake with the same surface)."""
        for needed in ("collective_rpc", "reset_prefix_cache"):
            if not hasattr(llm, needed):
                raise BackendUnavailable(
                    f"vLLM {self._vllm_version} lacks LLM.{needed} (weight updates); {INSTALL_HINT}"
                )
        self._llm = llm
        self._sampling_params_cls = sampling_params_cls
        self._top_k_off = int(sampling_params_cls().top_k)  # -1 on older vLLM, 0 on newer
        engine = llm.llm_engine
        model_config = getattr(engine, "model_config", None) or engine.vllm_config.model_config
        self.max_model_len = int(model_config.max_model_len)

    # ------------------------------------------------------------------ setup
    def _model_dir(self) -> Path:
        """The HF model directory vLLM loads; the embedded default is exported to a temp dir."""
        if self.spec.path is not None:
            path = Path(self.spec.path).expanduser()
            if not (path / "config.json").is_file():
                raise BackendError(f"{path} is not a model directory (no config.json)")
            return path
        from policy.model import build_model

        self._tmp = tempfile.TemporaryDirectory(prefix="rollout-swarm-vllm-")
        build_model(self.spec).save_pretrained(self._tmp.name, safe_serialization=True)
        return Path(self._tmp.name)

    # ------------------------------------------------------------------ weights
    def load_state_dict(
        self,
        version: int,
        state_dict: Mapping[str, Any],
        changed: Collection[str] | None = None,
    ) -> None:
        """Stream ``version`` into the engine (only ``changed`` when given), between two checked
        prefix-cache resets (:mod:`node.backends.vllm_weights`). A busy cache before the update
        refuses the version with the old weights untouched; any failure after weights moved
        leaves ``loaded_version`` None (the node reloads in full)."""
        with self._lock:
            self._reset_prefix_cache()  # refuse before touching weights: the old version stays
            for lora_version in list(self._loras):  # full weights from here on: no adapters
                self._drop_lora(lora_version)
            if changed is not None and not changed:
                self.loaded_version = version
                return
            previous = self.loaded_version
            send = changed if previous is not None else None  # unknown base: load in full
            need = staging_need(
                state_dict, send, dtype=self.spec.dtype, chunk_bytes=self.update_chunk_bytes
            )
            where = pick_staging_dir(need, staging_candidates(self.staging_dir))  # before any write
            method: Any = "rollout_swarm_load_file" if self._extension else _worker_load_file
            self.loaded_version = None  # from here on the engine may hold a mix of versions
            try:
                stats = stream_update(
                    state_dict,
                    send,
                    lambda path: self._llm.collective_rpc(method, args=(path,)),
                    dtype=self.spec.dtype,
                    chunk_bytes=self.update_chunk_bytes,
                    staging=[where],
                )
            except BackendError:
                raise
            except Exception as exc:
                raise BackendError(
                    f"loading version {version} into vLLM {self._vllm_version} failed: {exc}"
                ) from exc
            self._reset_prefix_cache()
            self.loaded_version = version
            self.last_update = stats
            log.info(
                "vLLM loaded v%d: %d tensors, %.1f MiB in %d chunks via %s, %.2f s",
                version,
                stats.tensors,
                stats.bytes / (1 << 20),
                stats.chunks,
                stats.staging_dir,
                stats.seconds,
            )

    # ------------------------------------------------------------------ LoRA
    def base_fingerprint(self) -> str | None:
        if self.max_lora_rank is None:
            return None  # the engine was not started for adapters
        if self._lora_base is None:
            from policy.lora import base_fingerprint

            self._lora_base = base_fingerprint(self.spec)
        return self._lora_base

    def holds_adapter(self, version: int) -> bool:
        return version in self._loras

    def load_adapter(
        self, version: int, tensors: Mapping[str, Any], *, rank: int, alpha: float, keep: int
    ) -> None:
        """Write ``version``'s adapter as a peft directory vLLM loads on its first request."""
        from policy.lora import adapter_modules

        if self.max_lora_rank is None or rank > self.max_lora_rank:
            raise BackendError(
                f"LoRA v{version} has rank {rank}; restart the node with vllm_max_lora_rank >= "
                f"{rank} in node.toml (now {self.max_lora_rank})"
            )
        if self.loaded_version is not None and not self._loras:
            # full weights were streamed over the base: the adapter would not apply to it
            raise BackendError(
                f"LoRA v{version} after full versions: restart the node on the base model"
            )
        modules = adapter_modules(tensors, rank)  # LoraError when malformed
        from vllm.lora.request import LoRARequest

        if self._lora_dirs is None:
            self._lora_dirs = tempfile.TemporaryDirectory(prefix="rollout-swarm-lora-")
        path = Path(self._lora_dirs.name) / f"v{version}"
        write_peft_adapter(path, tensors, modules, rank=rank, alpha=alpha)
        with self._lock:
            self._loras[version] = LoRARequest(f"v{version}", version + 1, str(path))
            while len(self._loras) > max(1, min(keep, self.max_loras)):
                old = next(iter(self._loras))
                self._drop_lora(old)
            self.loaded_version = version

    def activate_adapter(self, version: int) -> None:
        if version not in self._loras:
            raise KeyError(f"LoRA v{version} is not held by this backend")
        with self._lock:
            self.loaded_version = version

    def _drop_lora(self, version: int) -> None:
        request = self._loras.pop(version)
        remove = getattr(getattr(self._llm, "llm_engine", None), "remove_lora", None)
        if remove is not None:  # free the engine's slot now (it would evict it anyway)
            remove(request.lora_int_id)
        import shutil

        shutil.rmtree(request.lora_path, ignore_errors=True)

    def _lora_request(self) -> Any:
        """The request's adapter: the loaded version's, or None for full versions."""
        return self._loras.get(self.loaded_version) if self.loaded_version is not None else None

    def _reset_prefix_cache(self) -> None:
        reset_prefix_cache_checked(self._llm.reset_prefix_cache, timeout_s=self.reset_timeout_s)

    # ------------------------------------------------------------------ sampling
    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingConfig
    ) -> list[list[SampleOut]]:
        self.check_requests(requests, sampling)
        if not self.processed_logprobs and not sampling.is_plain:
            raise BackendError(
                f"vLLM {self._vllm_version} returns raw log-probs only; use temperature=1, "
                "top_p=1, top_k=0 or upgrade to vllm>=0.10.2"
            )
        longest = max((len(r.prompt_token_ids) for r in requests), default=0)
        if longest + sampling.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"prompt of {longest} tokens + max_new_tokens {sampling.max_new_tokens} exceeds "
                f"max_model_len {self.max_model_len}"
            )
        stops = sorted(self.stop_set(sampling))
        with self._lock:
            if self.seeded_draws:
                return self._generate_seeded(requests, sampling, stops)
            return self._generate_own_sampler(requests, sampling, stops)

    def _generate_seeded(
        self, requests: list[GenerationRequest], sampling: SamplingConfig, stops: list[int]
    ) -> list[list[SampleOut]]:
        """Every token drawn by :class:`node.backends.vllm_sampler.SeededInverseCDFProcessor`
        with ``draw_tokens`` at the sample's seeded uniforms; vLLM's own request settings are
        plain, and the behaviour log-probs are the processor's, read back from the workers."""
        prompts: list[dict[str, Any]] = []
        params: list[Any] = []
        tags: list[str] = []
        for req in requests:
            for j in range(req.n):
                tag = f"{id(self):x}-{next(self._tags)}"
                tags.append(tag)
                prompts.append({"prompt_token_ids": list(req.prompt_token_ids)})
                params.append(
                    self._sampling_params_cls(
                        n=1,
                        temperature=1.0,
                        top_p=1.0,
                        top_k=self._top_k_off,
                        max_tokens=sampling.max_new_tokens,
                        stop_token_ids=stops,
                        detokenize=False,  # no seed: vLLM's RNG cannot change a one-hot row
                        extra_args=extra_args(
                            tag,
                            sample_seed(req.seed, j),
                            len(req.prompt_token_ids),
                            sampling.temperature,
                            sampling.top_p,
                            sampling.top_k,
                        ),
                    )
                )
        lora = self._lora_request()
        kw = {"lora_request": lora} if lora is not None else {}
        try:
            outputs = self._llm.generate(prompts, params, use_tqdm=False, **kw)
        finally:  # drained even when generate failed: no draws left behind in the workers
            drawn = self._llm.collective_rpc("rollout_swarm_drain_draws", args=(tags,))[0]
        if len(outputs) != len(prompts):
            raise BackendError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        stop_set = set(stops)
        flat = [
            _seeded_sample(o.outputs[0], drawn.get(tag, []), stop_set)
            for o, tag in zip(outputs, tags, strict=True)
        ]
        return _group(requests, flat)

    def _generate_own_sampler(
        self, requests: list[GenerationRequest], sampling: SamplingConfig, stops: list[int]
    ) -> list[list[SampleOut]]:
        """vLLM's own sampler (no seeded-draw processor in this vLLM): processed log-probs, but
        draws the coordinator cannot replay (local benchmarks only)."""
        prompts: list[dict[str, Any]] = []
        params: list[Any] = []
        for req in requests:
            for j in range(req.n):
                prompts.append({"prompt_token_ids": list(req.prompt_token_ids)})
                params.append(
                    self._sampling_params_cls(
                        n=1,
                        temperature=sampling.temperature,
                        top_p=sampling.top_p,
                        top_k=sampling.top_k if sampling.top_k > 0 else self._top_k_off,
                        max_tokens=sampling.max_new_tokens,
                        stop_token_ids=stops,
                        seed=sample_seed(req.seed, j),
                        logprobs=0,
                        detokenize=False,
                    )
                )
        lora = self._lora_request()
        kw = {"lora_request": lora} if lora is not None else {}
        outputs = self._llm.generate(prompts, params, use_tqdm=False, **kw)
        if len(outputs) != len(prompts):
            raise BackendError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        stop_set = set(stops)
        return _group(requests, [_to_sample(o.outputs[0], stop_set) for o in outputs])

    def close(self) -> None:
        llm = getattr(self, "_llm", None)
        if llm is not None:
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            shutdown = getattr(core, "shutdown", None)
            if shutdown is not None:
                shutdown()
            self._llm = None
            gc.collect()
            import torch

            torch.cuda.empty_cache()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        if self._lora_dirs is not None:
            self._lora_dirs.cleanup()
            self._lora_dirs = None
            self._loras.clear()


def write_peft_adapter(
    path: Path,
    tensors: Mapping[str, Any],
    modules: Mapping[str, Any],
    *,
    rank: int,
    alpha: float,
) -> None:
    """An adapter in peft's on-disk format, which vLLM's ``LoRARequest`` loads:
    ``adapter_config.json`` (rank, alpha, the adapted modules' short names, dropout 0) and
    ``adapter_model.safetensors`` with the tensors under ``base_model.model.<name>``."""
    import json

    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    targets = sorted({name.rsplit(".", 1)[-1] for name in modules})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": targets,
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": None,
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=1))
    weights = {f"base_model.model.{k}": v.contiguous() for k, v in tensors.items()}
    save_file(weights, str(path / "adapter_model.safetensors"))


def _group(requests: list[GenerationRequest], flat: list[SampleOut]) -> list[list[SampleOut]]:
    out: list[list[SampleOut]] = []
    k = 0
    for req in requests:
        out.append(flat[k : k + req.n])
        k += req.n
    return out


def _seeded_sample(
    completion: Any, drawn: list[tuple[int, float]], stop_set: set[int]
) -> SampleOut:
    """A :class:`SampleOut` from vLLM's tokens and the processor's draws, which must agree token
    for token (anything else means the processor did not run on every row: refuse the batch)."""
    token_ids = [int(t) for t in completion.token_ids]
    if len(drawn) != len(token_ids) or any(
        d[0] != t for d, t in zip(drawn, token_ids, strict=False)
    ):
        raise BackendError(
            f"vLLM's tokens disagree with the seeded draws ({len(token_ids)} tokens, "
            f"{len(drawn)} draws): is the logits processor loaded (speculative decoding off)?"
        )
    return _finish(token_ids, [float(lp) for _, lp in drawn], completion.finish_reason, stop_set)


def _to_sample(completion: Any, stop_set: set[int]) -> SampleOut:
    """Convert one vLLM ``CompletionOutput`` (n=1) to a :class:`SampleOut`, checking it."""
    token_ids = [int(t) for t in completion.token_ids]
    if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
        raise BackendError("vLLM returned no per-token logprobs; is logprobs=0 supported?")
    logprobs = [float(completion.logprobs[i][t].logprob) for i, t in enumerate(token_ids)]
    return _finish(token_ids, logprobs, completion.finish_reason, stop_set)


def _finish(
    token_ids: list[int], logprobs: list[float], reason: Any, stop_set: set[int]
) -> SampleOut:
    if reason == "stop":
        if not token_ids or token_ids[-1] not in stop_set:
            raise BackendError(f"vLLM stopped without a stop token (stop_reason={reason!r})")
        return SampleOut(token_ids, logprobs, "stop")
    if reason == "length":
        if token_ids and token_ids[-1] in stop_set:  # vLLM checks the length cap first
            return SampleOut(token_ids, logprobs, "stop")  # the stop wins (protocol.md §12.2)
        return SampleOut(token_ids, logprobs, "length")
    raise BackendError(f"vLLM finished a sample with reason {reason!r} (aborted?)")


class VLLMWorkerExtension:
    """Mixed into vLLM's worker class via ``worker_extension_cls`` (vLLM >= 0.8.3), so the
    engine can call these by name through ``collective_rpc`` (no pickled code)."""

    def rollout_swarm_load_file(self, path: str) -> int:
        return _worker_load_file(self, path)

    def rollout_swarm_drain_draws(self, tags: list[str]) -> dict[str, list[tuple[int, float]]]:
        from node.backends.vllm_sampler import drain

        return drain(tags)


def _worker_load_file(worker: Any, path: str) -> int:
    """Runs inside each vLLM worker: stream one staged safetensors file into the worker's model
    tensor by tensor, with vLLM's own name mapping (stacked qkv / gate_up, tied embeddings)."""
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    device = next(model.parameters()).device
    return worker_load_file(model, path, device)


def _engine_supports(field_name: str) -> bool:
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:  # pragma: no cover
        return False
    return field_name in {f.name for f in dataclasses.fields(EngineArgs)}


def _read_json(path: Path) -> dict[str, Any]:
    import json

    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise BackendError(f"{path} is not a JSON object")
    return data


def _read_config(model_dir: Path) -> dict[str, Any]:
    cfg = _read_json(model_dir / "config.json")
    if "vocab_size" not in cfg:  # multimodal configs nest the text config
        cfg = {**cfg, **cfg.get("text_config", {})}
    if not isinstance(cfg.get("vocab_size"), int):
        raise BackendError(f"{model_dir}/config.json has no integer vocab_size")
    return cfg
