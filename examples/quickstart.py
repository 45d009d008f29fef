"""Generate with a 20% H2O cache from the model that ships with h2o_compile (offline, CPU, seconds)."""


import h2o_compile
from h2o_compile.zoo import load_tiny

model, tokenizer = load_tiny()
opt = h2o_compile.optimize(model, budget=0.2)

tokenizer.padding_side = "left"
prompts = ["The history of the city begins in the twelfth century, when", "Natasha looked at Pierre and"]
batch = tokenizer(prompts, return_tensors="pt", padding=True)
out = opt.generate(**batch, max_new_tokens=40, pad_token_id=tokenizer.pad_token_id)
for row in out:
    print(tokenizer.decode(row, skip_special_tokens=True), "\n")
print(f"KV cache: {opt.kv_cache_bytes() / 1024:.0f} KiB (a full cache would hold "
      f"{opt.full_cache_bytes(*out.shape) / 1024:.0f} KiB)")
