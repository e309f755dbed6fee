"""Weight-update time per version of the ``vllm`` backend (CUDA + vLLM; bench/vllm_gpu.sh).

A random Qwen2 model of the Qwen2.5-0.5B shape (hidden 896, 24 layers, vocab 151,936, tied
embeddings: ~0.49B parameters; no hub access needed) is saved to a temp directory and served by
:class:`node.backends.vllm.VLLMBackend` in bf16. Each version is a perturbed copy of the weights
on the CPU (fp32, as the node holds a downloaded checkpoint) loaded with ``load_state_dict``:

* full  -- every tensor (``changed=None``);
* delta -- ``changed`` = the attention projections of every layer (a quarter of the tensors, as a
  delta checkpoint names the tensors whose digests changed).

After the last update the backend samples once and the draws are re-scored with the hf
reference on the same weights (``policy.scoring.score_logprobs``), so a stale prefix cache or a
missed tensor shows up as a log-prob gap. Prints a table and writes the
``<!-- bench:vllm_update:start -->`` section of docs/benchmarks.md.

Usage: ``python bench/vllm_update.py [--versions 3] [--layers 24] [--no-write]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _report import write_section  # noqa: E402

from node.backends import GenerationRequest, SamplingConfig  # noqa: E402
from node.backends.vllm import VLLMBackend  # noqa: E402
from policy.model import ModelSpec  # noqa: E402
from policy.scoring import score_logprobs  # noqa: E402

SECTION = "vllm_update"


def qwen_05b(layers: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=151_936,
        hidden_size=896,
        intermediate_size=4_864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=2_048,
        tie_word_embeddings=True,
        eos_token_id=151_643,
        bos_token_id=151_643,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()


def perturb(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3 * torch.randn(p.shape, generator=g))
    return {k: v.detach() for k, v in model.state_dict().items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    model = qwen_05b(a.layers)
    n_params = sum(p.numel() for p in model.parameters())
    times: dict[str, list[float]] = {"full": [], "delta": []}
    stats: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        model.float()
        backend = VLLMBackend(
            ModelSpec(path=tmp, dtype="bfloat16"), gpu_memory_utilization=0.6, max_model_len=512
        )
        attn = [n for n in model.state_dict() if ".self_attn." in n]
        version = 0
        for kind in ("full", "delta"):
            for _ in range(a.versions):
                version += 1
                sd = perturb(model, version)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                backend.load_state_dict(version, sd, changed=None if kind == "full" else attn)
                torch.cuda.synchronize()
                times[kind].append(time.perf_counter() - t0)
                u = backend.last_update
                assert u is not None
                stats[kind] = f"{u.tensors} tensors, {u.bytes / 2**20:,.0f} MiB, {u.chunks} chunks"
        # the engine serves the last version: re-score its draws with the hf reference
        reqs = [GenerationRequest(list(range(10 + i, 30 + i)), 2, seed=i) for i in range(4)]
        cfg = SamplingConfig(max_new_tokens=16, stop_token_ids=[])
        outs = backend.generate(reqs, cfg)
        backend.close()
        ref = model.to("cuda", torch.bfloat16)
        flat = [(r.prompt_token_ids, s) for r, g in zip(reqs, outs, strict=True) for s in g]
        want = score_logprobs(ref, [p for p, _ in flat], [s.token_ids for _, s in flat])
        gap = max(
            abs(x - y)
            for w, (_, s) in zip(want, flat, strict=True)
            for x, y in zip(w, s.logprobs, strict=True)
        )
    lines = [
        f"<!-- bench:{SECTION}:start -->",
        "### vLLM weight-update time per version (`bench/vllm_update.py`)",
        "",
        f"{torch.cuda.get_device_name(0)}, random Qwen2 of the Qwen2.5-0.5B shape "
        f"({n_params / 1e9:.2f}B parameters, {a.layers} layers), bf16 engine, fp32 CPU state dict; "
        "streamed in 256 MiB chunks between two checked prefix-cache resets. Max |log-prob gap| "
        f"of the last version's draws vs an hf bf16 re-score: {gap:.3f}.",
        "",
        "| update | what moved | median s | min s | max s |",
        "|---|---|---|---|---|",
    ]
    for kind, ts in times.items():
        lines.append(
            f"| {kind} | {stats[kind]} | {statistics.median(ts):.2f} | {min(ts):.2f} | "
            f"{max(ts):.2f} |"
        )
    lines.append(f"<!-- bench:{SECTION}:end -->")
    text = "\n".join(lines)
    print(text)
    if not a.no_write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
