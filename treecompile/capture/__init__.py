"""From a model to a captured graph: the only layer that names other libraries' internals.

`dynamo` runs Dynamo with treecompile's backend (the model's attention routed to the marker
ops, its mask builders and position code as the passes expect them); `hf_interfaces` is the
Hugging Face adapter (attention and experts interfaces); `drop_ins` swaps known kernels for
single custom ops before capture; `router_aux` wraps a mixture-of-experts router's auxiliary loss;
`model_loader` builds models from names and configs; `call` compiles and calls a rewritten
graph and runs its LM head.

Layer 4: imports kernels, core and passes.
"""
