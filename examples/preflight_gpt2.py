"""Pre-flight on a Transformers config: GPT-2 small at sequence 1024 on a 24 GiB GPU, predicted on a laptop (docs/preflight.md)."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from memcallbacks.preflight import max_batch_size, predict

config = GPT2Config(n_layer=12, n_embd=768, n_head=12)  # GPT-2 small's shapes; nothing downloaded
with torch.device("meta"):  # no weights allocated
    model = GPT2LMHeadModel(config)

def make_batch(n):
    ids = torch.empty(n, 1024, dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": ids}

p = predict(model, make_batch(8), "adamw", precision="bf16-mixed", device="cuda")
print(p)
fit = max_batch_size(model, make_batch, 24 * 2**30, "adamw", precision="bf16-mixed", device="cuda")
print(fit)
