"""Text generation with transformers' pipeline on an H2O-optimized model: batched prompts and a chat.

The optimized model goes where a transformers causal LM goes; its KV cache keeps half of each sequence.
"""

from transformers import pipeline

import h2o_compile

model, tokenizer = h2o_compile.load_tiny()
tokenizer.padding_side = "left"  # a batch of prompts is padded on the left, as generate expects
if tokenizer.chat_template is None:
    # The shipped model was trained on plain prose and has no chat template: give it a minimal one.
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant:{% endif %}")

opt = h2o_compile.optimize(model, budget=0.5, config="recommended")
generator = pipeline("text-generation", model=opt, tokenizer=tokenizer)

prompts = ["The old man looked at the sea and", "In the morning the soldiers"]
for out in generator(prompts, max_new_tokens=20, do_sample=False, batch_size=2, return_full_text=False):
    print("greedy :", out[0]["generated_text"])

chat = [{"role": "user", "content": "Tell me about the war."}]
reply = generator(chat, max_new_tokens=20, do_sample=True, temperature=0.8, top_k=50)
print("chat   :", reply[0]["generated_text"][-1]["content"])
