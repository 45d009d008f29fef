"""Score a multiple-choice item by loglikelihood, as lm-evaluation-harness does, through forward(...).logits.

Each choice's score is the sum of log P(continuation token | everything before it). ``opt(input_ids).logits``
gives the logits each position gets from the cache H2O keeps when it decodes the sequence one token at a time
(budget 0.3 here), so the scores measure the method, not the full cache.
"""

import torch

import h2o_compile

model, tokenizer = h2o_compile.load_tiny()
opt = h2o_compile.optimize(model, budget=0.3)

context = "The soldiers marched all night, and in the morning they"
choices = [" reached the river.", " ate the moon.", " sang a purple."]


def loglikelihoods(lm, context: str, continuations: list[str]) -> list[float]:
    """Sum of the continuation tokens' log-probabilities given the context, per continuation (one batch)."""
    ctx = tokenizer(context)["input_ids"]
    rows = [ctx + tokenizer(c, add_special_tokens=False)["input_ids"] for c in continuations]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)     # right-padded, as the harness pads
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
    with torch.no_grad():
        logprobs = torch.log_softmax(lm(ids, attention_mask=mask).logits.float(), dim=-1)   # [N, S, V]
    scores = []
    for i, row in enumerate(rows):
        targets = torch.tensor(row[len(ctx):])                         # the continuation's tokens
        predicted = logprobs[i, len(ctx) - 1:len(row) - 1]            # the positions that predict them
        scores.append(float(predicted.gather(-1, targets[:, None]).sum()))
    return scores


for name, lm in (("H2O, budget 0.3", opt), ("full cache", model)):
    scores = loglikelihoods(lm, context, choices)
    best = max(range(len(choices)), key=scores.__getitem__)
    print(f"{name:16s}", " ".join(f"{s:8.2f}" for s in scores), "-> picks", repr(choices[best]))
