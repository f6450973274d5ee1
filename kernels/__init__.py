"""Kernels the rewritten graphs call, by family: `attention` (tree masks, FlexAttention and
the CPU kernels), `scans` (recurrences and scans along paths), `logprobs` (the fused LM head),
`collectives` (context-parallel gathers); `conv` (the causal conv along paths), `grouped_mm`
(experts) and `dtypes` beside them."""
