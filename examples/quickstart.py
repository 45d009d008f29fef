"""Generate with a 20% H2O cache from the model that ships with h2o_compile (offline, CPU, seconds)."""


import h2o_compile
from h2o_compile.zoo import load_tiny

model, tokenizer = load_tiny()
opt = h2o_compile.optimize(model, budget=0.2, config="recommended")

tokenizer.padding_side = "left"
prompts = ["Prince Andrew rode along the line of soldiers and", "Natasha looked at Pierre and"]
batch = tokenizer(prompts, return_tensors="pt", padding=True)
# The shipped model learned wikitext's "<unk>" marker for rare words: keep it out of the text.
out = opt.generate(**batch, max_new_tokens=40, pad_token_id=tokenizer.pad_token_id,
                   bad_words_ids=tokenizer([" <unk>", "<unk>"], add_special_tokens=False)["input_ids"])
for row in out:
    print(tokenizer.decode(row, skip_special_tokens=True), "\n")
print(f"KV cache: {opt.kv_cache_bytes() / 1024:.0f} KiB (a full cache would hold "
      f"{opt.full_cache_bytes(*out.shape) / 1024:.0f} KiB)")
