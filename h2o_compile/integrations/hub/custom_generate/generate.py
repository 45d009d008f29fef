"""H2O KV-cache eviction for transformers' generate (h2o_compile.integrations.custom_generate):

    model.generate(**inputs, custom_generate=<this folder's parent>, trust_remote_code=True, budget=0.2,
                   config="recommended")
"""

from h2o_compile.integrations.custom_generate import generate  # noqa: F401  (what transformers calls)
