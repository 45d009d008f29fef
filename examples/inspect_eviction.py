"""Which tokens does H2O keep? Feed a text step by step and print the kept positions of one layer and head."""


import h2o_compile
from h2o_compile.zoo import load_tiny

model, tokenizer = load_tiny()
ids = tokenizer("It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
                "age of foolishness, it was the epoch of belief, it was the epoch of incredulity.",
                return_tensors="pt")["input_ids"]
opt = h2o_compile.optimize(model, budget=12, policy="h2o")   # 12 slots: 6 recent + 6 heavy hitters
opt.reset(batch_size=1, max_seq_len=ids.shape[1])
opt.step(ids[:, :4])                                         # a short prompt block, then one token at a time
for t in range(4, ids.shape[1]):
    opt.step(ids[:, t:t + 1])
kept = sorted(p for p in opt.kept_positions(layer=3)[0, 0].tolist() if p >= 0)
tokens = tokenizer.convert_ids_to_tokens(ids[0])
print("kept by layer 3, KV head 0:", [f"{p}:{tokens[p]}" for p in kept])
