"""The whole-tree call of a `treecompile.TreeCompiledModel`: its graph built (the model under
`tree_forward`, compiled with the wrapper's backend), its arguments for a batch, and the
compiled call under the wrapper's swaps."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from treecompile.capture.call import (argument_names, call_settings, compile_failure, compile_named, failed_capture,
                                      recompile_limit_refusal, run_head)
from treecompile.capture.dynamo import (extended_buffers, hf_interfaces, install_output_hooks, short_buffers,
                                        swapped_kernels)
from treecompile.capture.torch_swaps import TORCH_SWAPS
from treecompile.compile.graph_inputs import tree_call_inputs
from treecompile.compile.probe import probe_hook
from treecompile.core.batch import TreeBatch
from treecompile.core.errors import CaptureFailed, capture_error, row_count_error
from treecompile.passes import markers
from treecompile.passes.held_writes import held_run
from treecompile.passes.pipeline import CallState, make_backend

__all__ = ["WholeTreeCall"]


class WholeTreeCall:
    """What `treecompile.compile.wrapper.TreeCompiledModel` runs a whole tree with (a mixin
    over its fields: ``_inner``, ``_state``, ``_compiled``, the options)."""

    def _call(self, args: tuple, extend: list, rows: int, longest: int) -> tuple:
        """The compiled call under the wrapper's swaps (``extend``: buffers to extend for it)."""
        self._state.judge_cap = min((size for _, _, size in extend), default=0)
        hf = hf_interfaces(self._inner, self._route.routes) if self._is_hf else contextlib.nullcontext()
        with hf, swapped_kernels([*self._kernels, *self._route.mask_swaps, *TORCH_SWAPS]), \
                extended_buffers(extend, rows):
            with call_settings(), held_run():  # one state for a step of two calls (stream_logprob_loss)
                try:
                    return self._compiled(*args)
                except torch._dynamo.exc.BackendCompilerFailed as e:
                    # Our passes' refusals reach the user as themselves, not wrapped by Dynamo;
                    # a failure of the lowering after them as a refusal that says so.
                    failure = compile_failure(e)
                    raise failure from (failure.__cause__ if failure is e.inner_exception else e.inner_exception)
                except Exception as e:
                    if not failed_capture(e):  # a refusal already, or the compiled code's own error
                        raise
                    limit = recompile_limit_refusal(e)
                    if limit is not None:
                        raise limit from None
                    short = extend or short_buffers(self._inner, rows, longest)
                    raise CaptureFailed(row_count_error(self._inner, rows, longest, capture_error(e), short)) \
                        from None

    def _backend(self, device: torch.device, *, mask: str, state: CallState, passes, arguments,
                 keep_inputs: bool = False, before_commit=None):
        """The Dynamo backend for a graph of this wrapper on ``device``: ``passes``, then the
        wrapper's lowering (its default per device), recording into ``compile_records``. The
        whole-tree graph and the streamed part graph (:mod:`treecompile.stream.runner`) differ
        only in the arguments (``arguments``: the compiled function's, the batch)."""
        return make_backend(
            mask=mask,
            call_state=state,
            lowering=self._backend_name or ("inductor" if device.type == "cuda" else "aot_eager"),
            records=self.compile_records,
            passes=passes,
            scan_kernel=self.scan_kernel,
            dropout=self.dropout,
            keep_inputs=keep_inputs,
            arguments=arguments,
            before_commit=before_commit,
        )

    def _graph_parts(self) -> tuple[nn.Module, Any, Any, bool, float]:
        """What a compiled graph of this wrapper closes over, whole-tree or streamed part:
        ``(model, its call kwargs, router aux loss or None, entropy wanted, temperature)``.
        A model with a router aux loss gets HF's output-capturing hooks installed first."""
        if self._router_aux is not None:
            install_output_hooks(self._inner)
        return self._inner, self._call_kwargs, self._router_aux, "entropy" in self._outputs, self.temperature

    def _build(self, device: torch.device):
        inner, kwargs_of, router, want_entropy, temperature = self._graph_parts()

        def tree_forward(ids, positions, mask_buffers, block_tensors, structure, rows, slot, target, dest, weight,
                         path_count):
            ids = torch.ops.treecompile.tree_inputs(ids, [positions, *mask_buffers], list(block_tensors),
                                                    list(structure), path_count)
            out, loss, logprobs, entropy = run_head(inner, kwargs_of(positions), ids, positions, rows, slot, target,
                                                    dest, weight, temperature, want_entropy)
            aux = None
            if router is not None:
                # Per-path training counts each token once per path through it: path_count
                # weights each row's router statistics (see passes/moe.py).
                aux = router.tree_aux_loss(out.router_logits, path_count)
                loss = loss + router.coef * aux.to(loss.dtype)
            return markers.returned((loss, logprobs, aux, entropy))

        backend = self._backend(device, mask=self.mask, state=self._state, passes=self._passes,
                                arguments=argument_names(tree_forward), keep_inputs=self.verify.probes,
                                before_commit=probe_hook(self))
        return compile_named(tree_forward, "tree_forward", backend)

    def _inputs(self, batch: TreeBatch) -> tuple:
        """The compiled function's arguments for one batch (`tree_call_inputs`); the path structure for
        a model with sequence kernels or conv modules, one of its own code (it may shift the sequence,
        seen only in its graph: not captured twice), and one a capture found shifting (`NeedsStructure`)."""
        paths = self._structure or not self._is_hf
        inputs, self._state.layout, self._state.chunks = tree_call_inputs(batch, self.mask, paths)
        return inputs.args()
