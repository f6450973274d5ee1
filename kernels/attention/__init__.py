"""Tree attention: the mask rule and its ``mask_mod`` family (`masks`), its ``BlockMask`` from
per-block bounds (`blockmask`), FlexAttention on CUDA (`flex`, its options in `flex_options`),
the CPU kernels with their backward (`cpu_attention`), a model's own ``score_mod`` /
``mask_mod`` on path positions (`flex_mods`), and attention over a streamed part's prefix keys
and values (`prefix_attention`; as one FlexAttention call in `prefix_flex`; its plain reference
`prefix_attention_reference` in `naive`), and attention without a softmax (`pair_sum`; its
reference `tree_pair_sum_reference` in `naive`). The dense attention every kernel is tested against is
the per-path reference of `treecompile.core.reference`."""
