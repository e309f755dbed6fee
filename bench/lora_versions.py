"""LoRA versions: bytes per version (adapter vs full) and the hf backend's two ways of applying an
adapter ("merged" into the weights vs "unmerged" forward hooks): switch time, sampling time,
bit stability of a switch back, and how far the two modes' log-probs are apart.

    python bench/lora_versions.py                      # the embedded model (seconds)
    python bench/lora_versions.py --model-path ~/.cache/rollout-swarm/models/smollm2-float32 \
        --rank 8 --prompts 4 --samples 4 --tokens 32   # SmolLM2-135M (docs/models.md figures)
    python bench/lora_versions.py --model-path ... --bytes-only   # bytes per version only

Bytes are exact (safetensors as the trainer publishes them, ``--publish-dtype`` bf16 by default,
the full checkpoint with its tied ``lm_head.weight`` written out, as a full version carries it).
Times are CPU seconds (``time.process_time``) of this process with ``--threads`` torch threads,
the best of ``--repeats``: figures of record need a quiet machine (load average printed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-path", default=None, help="HF model directory (default: embedded)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--publish-dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--bytes-only", action="store_true", help="bytes per version, no sampling")
    args = ap.parse_args(argv)

    import torch

    from node.backends.base import GenerationRequest, SamplingConfig
    from node.backends.hf import HFBackend
    from policy.lora import AdapterState, adapter_state, inject_lora
    from policy.model import ModelSpec, build_model
    from swarm.checkpoint_io import cast_floats, state_dict_to_files

    torch.set_num_threads(args.threads)
    spec = ModelSpec(path=args.model_path)
    base = build_model(spec)
    full = state_dict_to_files(cast_floats(base.state_dict(), args.publish_dtype))
    full_bytes = sum(len(b) for b in full.values())
    params = sum(p.numel() for p in base.parameters())

    def adapter(seed: int) -> AdapterState:
        """A trained-looking adapter: A as peft initialises it, B random (not zero)."""
        model = build_model(spec)
        torch.manual_seed(seed)
        inject_lora(model, rank=args.rank, alpha=args.alpha, target_modules=["all-linear"])
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.normal_(0.0, 1e-3)
        tensors = adapter_state(model.named_parameters())
        rounded = cast_floats(tensors, args.publish_dtype)
        return AdapterState(rounded, base_model="sha256:" + "0" * 64, rank=args.rank,
                            alpha=args.alpha)  # fmt: skip

    adapters = {1: adapter(1), 2: adapter(2)}
    adapter_bytes = sum(len(b) for b in state_dict_to_files(adapters[1]).values())
    adapter_params = sum(t.numel() for t in adapters[1].values())
    out: dict[str, object] = {
        "model": args.model_path or "embedded",
        "load_avg_1m": os.getloadavg()[0],
        "threads": args.threads,
        "parameters": params,
        "adapter_parameters": adapter_params,
        "rank": args.rank,
        "publish_dtype": args.publish_dtype,
        "full_bytes": full_bytes,
        "adapter_bytes": adapter_bytes,
        "adapter_over_full": adapter_bytes / full_bytes,
    }
    if args.bytes_only:
        print(json.dumps(out, indent=1))
        return out
    vocab = int(base.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    requests = [
        GenerationRequest(torch.randint(4, vocab, (12,), generator=g).tolist(), args.samples, s)
        for s in range(args.prompts)
    ]
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.tokens)
    logprobs: dict[str, list[float]] = {}
    for mode in ("merged", "unmerged"):
        backend = HFBackend(spec, device="cpu", eos_token_ids=(), lora_mode=mode,  # type: ignore[arg-type]
                            lora_base="sha256:" + "0" * 64)  # fmt: skip
        t0 = time.process_time()
        backend.load_adapter(1, adapters[1], rank=args.rank, alpha=args.alpha, keep=3)
        backend.load_adapter(2, adapters[2], rank=args.rank, alpha=args.alpha, keep=3)
        load_s = (time.process_time() - t0) / 2
        switch, gen = [], []
        first = None
        for _ in range(args.repeats):
            for v in (1, 2):
                t0 = time.process_time()
                backend.activate_adapter(v)
                switch.append(time.process_time() - t0)
            backend.activate_adapter(1)
            t0 = time.process_time()
            outs = backend.generate(requests, sampling)
            gen.append(time.process_time() - t0)
            lps = [x for grp in outs for s in grp for x in s.logprobs]
            first = lps if first is None else first
        logprobs[mode] = first or []
        tokens = args.prompts * args.samples * args.tokens
        out[mode] = {
            "load_adapter_s": load_s,
            "switch_s": min(switch),
            "generate_s": min(gen),
            "tokens_per_cpu_s": tokens / min(gen),
            "bit_stable": _switch_back_same(backend, requests, sampling, first),
        }
        del backend
    a, b = logprobs["merged"], logprobs["unmerged"]
    out["merged_vs_unmerged_max_abs_logprob"] = max(
        (abs(x - y) for x, y in zip(a, b, strict=False)), default=0.0
    )
    print(json.dumps(out, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return out


def _switch_back_same(backend: object, requests: object, sampling: object, first: object) -> bool:
    """v1 → v2 → v1 again samples exactly what v1 sampled first (same seeds)."""
    backend.activate_adapter(2)  # type: ignore[attr-defined]
    backend.activate_adapter(1)  # type: ignore[attr-defined]
    outs = backend.generate(requests, sampling)  # type: ignore[attr-defined]
    return [x for grp in outs for s in grp for x in s.logprobs] == first


if __name__ == "__main__":
    main()
