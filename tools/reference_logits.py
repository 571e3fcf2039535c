"""Reference logits of the embedded GGUF from Hugging Face transformers (an independent
implementation), pinned in tests/gguf_reference_logits.json. Not a project dependency:

    pip install torch==2.13.0 transformers==5.12.1 accelerate gguf
    python tools/reference_logits.py ~/.cache/reasoner > tests/gguf_reference_logits.json

The ids are "<bos>Question: What is 12 + 7?\\nAnswer:" from our tokenizer (transformers' GGUF
tokenizer for Gemma is wrong, see shared FACTS.md), fed directly.
"""
import json
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
IDS = [2, 14977, 236787, 2900, 563, 236743, 236770, 236778, 900, 236743, 236832, 236881, 107,
       7925, 236787]

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], gguf_file=GGUF_NAME,
                                             dtype=torch.float32, attn_implementation="eager")
model.eval()
with torch.no_grad():
  logits = model(input_ids=torch.tensor([IDS]), use_cache=False).logits[0].float()
res = {"transformers": transformers.__version__, "torch": torch.__version__,
       "attn_implementation": "eager", "input_ids": IDS, "positions": {}}
for p in (12, 13, 14):
  v, i = torch.topk(logits[p], 8)
  res["positions"][str(p)] = {
      "top8": [[int(a), float(b)] for a, b in zip(i.tolist(), v.tolist())],
      "selected": {str(t): float(logits[p, t]) for t in [0, 1, 2, 107, 236770, 236832]},
      "argmax": int(logits[p].argmax()),
  }
print(json.dumps(res, indent=1))
