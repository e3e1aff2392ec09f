"""Helpers of the serving tests: the tiny Llama builder, a uvicorn thread, settings, polling."""

from __future__ import annotations

import time

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "disaggregated prefill and decoding for goodput optimized serving",
    "hello world, this is a tiny model used only in tests",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9",
]


def build_tiny_llama(folder) -> str:
    """Write a random 2-layer Llama with a small BPE tokenizer to `folder`; return it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                  unk_token="<unk>", bos_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


class ServerThread:
    """An app served by uvicorn in a thread on a free port."""

    def __init__(self, app) -> None:
        import socket
        import threading

        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        import time

        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return self

    def __exit__(self, *_) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def make_settings(model: str, **overrides):
    """Serving settings of the tiny model: 1 prefill + 1 decode unless overridden."""
    from distserve_engine.server.settings import ServeSettings

    doc = {"engine": {"model": model, "num_blocks": 64}, "model_name": "tiny",
           "deployment": "test", "max_prefill_tokens": 64, "max_decode_batch": 4,
           "slo": {"ttft_s": 5.0, "tpot_s": 1.0}, "instances": {"prefill": 1, "decode": 1}}
    doc.update(overrides)
    return ServeSettings.from_dict(doc)


def wait_until(predicate, timeout_s: float = 30.0) -> bool:
    """Poll until predicate() (bounded, so a bug fails instead of hanging)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def tiny_spec_yaml(model_path: str, name: str, planner: str = "numRequests: 50") -> str:
    """A DistServeDeployment of the tiny model on this machine's CPU: 1 prefill + 1 decode."""
    return f"""\
apiVersion: distserve.io/v1alpha1
kind: DistServeDeployment
metadata: {{name: {name}}}
spec:
  model: {{name: {model_path}/config.json, path: {model_path}, maxModelLen: 256}}
  slo: {{ttftSeconds: 5, tpotSeconds: 1}}
  cluster: {{accelerator: CPU, nodes: 1, gpusPerNode: 2}}
  placement:
    prefill: {{tp: 1, pp: 1, instances: 1}}
    decode: {{tp: 1, pp: 1, instances: 1}}
  planner: {{{planner}}}
  engine: {{device: cpu}}
"""
