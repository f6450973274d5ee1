"""The LM head's log-probabilities without the full logits: `fused` (the torch op, chunked over
rows), `fused_triton` (the Triton kernel it dispatches to on CUDA) and `naive` (their plain
reference)."""
