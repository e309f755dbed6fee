"""``vllm`` backend: a vLLM ``LLM`` engine on a CUDA host, weights swapped without restart.

vLLM is imported inside :class:`VLLMBackend` only, so this module loads anywhere; building the
backend on a machine without CUDA or vLLM raises :class:`BackendUnavailable` in one line.

Correctness choices (all checked by ``tests/unit/test_backends_vllm.py``, marker ``gpu``):
- log-probs: the engine is built with ``logprobs_mode="processed_logprobs"`` (vLLM >= 0.10.2) so
  ``SamplingParams(logprobs=0)`` returns the sampled token's log-prob under the distribution
  after temperature/top-k/top-p. On older vLLM only plain sampling (T=1, top_p=1, top_k=0) is
  accepted, where raw == processed; anything else raises instead of returning wrong log-probs.
- seeds: each sample is its own vLLM request with ``n=1`` and ``seed=sample_seed(seed, j)``
  (prefix caching shares the prompt's KV across the group), so samples do not depend on ``n``.
- sampling rule: not yet the swarm's. vLLM draws with its own sampler (torch RNG), so its tokens
  are not ``policy.draw.draw_tokens`` at the sample's seeded uniforms and the coordinator's replay
  refuses them; :attr:`sampling_rule` is None and a node will not run this backend until a vLLM
  sampler (logits processor) calls ``draw_tokens`` with ``sample_uniforms(sample seed)[t]`` for
  each row's position ``t`` and sets ``sampling_rule = policy.draw.SAMPLING_RULE`` (the vLLM
  issue).
- EOS: the engine runs with ``skip_tokenizer_init=True`` (token ids in, token ids out), where
  vLLM does not know the EOS id, so EOS ids are always passed as ``stop_token_ids``; vLLM keeps
  the stop token in ``token_ids``.
- weights: :meth:`load_state_dict` writes a safetensors file (``/dev/shm`` when present) and
  runs ``model.load_weights`` inside every worker through ``LLM.collective_rpc`` (vLLM >= 0.8):
  by method name via :class:`VLLMWorkerExtension` (``worker_extension_cls``, no pickled code),
  else with a module-level callable; then it resets the prefix cache (cached KV of the old
  weights would otherwise be reused).
  Unquantized models only.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import tempfile
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from node.backends.base import (
    BackendError,
    BackendUnavailable,
    GenerationRequest,
    InferenceBackend,
    SampleOut,
    SamplingConfig,
    sample_seed,
)
from policy.model import ModelSpec

log = logging.getLogger(__name__)

INSTALL_HINT = "install 'rollout-swarm[vllm]' on a CUDA host"


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
        **engine_kwargs: Any,
    ) -> None:
        self.spec = spec or ModelSpec()
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
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
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
        kwargs.update(engine_kwargs)
        try:
            self._llm = LLM(**kwargs)
        except Exception as exc:
            raise BackendError(f"vLLM could not start on {model_dir}: {exc}") from exc
        if not hasattr(self._llm, "collective_rpc"):
            raise BackendUnavailable(
                f"vLLM {self._vllm_version} lacks LLM.collective_rpc (weight updates); "
                "install vllm>=0.8"
            )
        from vllm import SamplingParams

        self._sampling_params_cls = SamplingParams
        self._top_k_off = int(SamplingParams().top_k)  # -1 on older vLLM, 0 on newer
        engine = self._llm.llm_engine
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
        from safetensors.torch import save_file

        tensors: dict[str, Any] = {}
        seen: set[int] = set()
        for name, tensor in state_dict.items():
            if changed is not None and name not in changed:
                continue  # bit-identical to the loaded version: vLLM keeps it (issue 20)
            t = tensor.detach().to("cpu").contiguous()
            if t.data_ptr() in seen:  # tied weights share storage; safetensors refuses that
                t = t.clone()
            seen.add(t.data_ptr())
            tensors[name] = t
        if not tensors:  # nothing changed
            self.loaded_version = version
            return
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="rollout-swarm-weights-", suffix=".safetensors", dir=shm)
        os.close(fd)
        try:
            save_file(tensors, path)
            method: Any = "rollout_swarm_load_weights" if self._extension else _worker_load_weights
            try:
                self._llm.collective_rpc(method, args=(path,))
            except Exception as exc:
                raise BackendError(
                    f"loading version {version} into vLLM {self._vllm_version} failed: {exc}"
                ) from exc
        finally:
            os.unlink(path)
        reset = getattr(self._llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()
        else:  # pragma: no cover - very old vLLM
            log.warning("vLLM has no reset_prefix_cache(); cached prompt KV may be stale")
        self.loaded_version = version

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
        outputs = self._llm.generate(prompts, params, use_tqdm=False)
        if len(outputs) != len(prompts):
            raise BackendError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        stop_set = set(stops)
        flat = [_to_sample(o.outputs[0], stop_set) for o in outputs]
        out: list[list[SampleOut]] = []
        k = 0
        for req in requests:
            out.append(flat[k : k + req.n])
            k += req.n
        return out

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


def _to_sample(completion: Any, stop_set: set[int]) -> SampleOut:
    """Convert one vLLM ``CompletionOutput`` (n=1) to a :class:`SampleOut`, checking it."""
    token_ids = [int(t) for t in completion.token_ids]
    if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
        raise BackendError("vLLM returned no per-token logprobs; is logprobs=0 supported?")
    logprobs = [float(completion.logprobs[i][t].logprob) for i, t in enumerate(token_ids)]
    reason = completion.finish_reason
    if reason == "stop":
        if not token_ids or token_ids[-1] not in stop_set:
            raise BackendError(f"vLLM stopped without a stop token (stop_reason={reason!r})")
        return SampleOut(token_ids, logprobs, "stop")
    if reason == "length":
        return SampleOut(token_ids, logprobs, "length")
    raise BackendError(f"vLLM finished a sample with reason {reason!r} (aborted?)")


class VLLMWorkerExtension:
    """Mixed into vLLM's worker class via ``worker_extension_cls`` (vLLM >= 0.8.3), so the
    engine can call :meth:`rollout_swarm_load_weights` by name through ``collective_rpc``."""

    def rollout_swarm_load_weights(self, path: str) -> int:
        return _worker_load_weights(self, path)


def _worker_load_weights(worker: Any, path: str) -> int:
    """Runs inside each vLLM worker (via ``collective_rpc``): load a safetensors file into the
    worker's model with vLLM's own name mapping (stacked qkv / gate_up, tied embeddings)."""
    from safetensors.torch import load_file

    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    device = next(model.parameters()).device
    weights = load_file(path, device=str(device))
    model.load_weights(iter(weights.items()))
    return len(weights)


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
