"""Greedy text of one prompt from a single engine (no router, no KV transfer).

Run inside an engine pod, where the model and the serving settings are:
    kubectl exec -i POD -- python - /etc/distserve/serve.json "PROMPT" 16 < e2e/reference.py
The end-to-end test compares it with what the disaggregated deployment answers.
"""

import sys

from distserve_engine.generate import generate
from distserve_engine.runner import ModelRunner
from distserve_engine.sampling import SamplingParams
from distserve_engine.server.settings import ServeSettings

config_path, prompt, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
runner = ModelRunner(ServeSettings.load(config_path).engine)
params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
(seq,) = generate(runner, [runner.tokenizer.encode(prompt)], params)
print(runner.tokenizer.decode(seq.output_token_ids), end="")
