"""``tree_compile(model)``: train any causal LM on a packed tree batch, exactly.

    model = tree_compile(model)            # keeps the model's parameters
    out = model(treecompile.pack(trees))   # out.loss, out.logprobs
    out.loss.backward()                    # grads land on the original parameters

The model is captured with Dynamo as one graph, rewritten by the passes in
:mod:`treecompile.passes.pipeline` (attention, positions, loss, MoE, verify) and lowered
with AOTAutograd (CPU) or Inductor (CUDA). The tree tensors of each batch reach the graph
as inputs through a marker op; the BlockMask is built once per batch, outside the model.

One module: the entry point and the wrapper it returns (its calls, compile records, copying
and pickling); what it uses lives in the layers below (docs/architecture.md).
"""

from __future__ import annotations

import copy
import functools
import sys
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from treecompile.core.advice import warn_position_overflow
from treecompile.core.batch import TreeBatch
from treecompile.capture.call import AttentionRoute, CallSetup, TreeOutput, device_of
from treecompile.capture.dynamo import (call_kwargs, eager_mask_skips, short_buffers, is_hf_model, mask_builder_swaps,
                                        model_vocab_size, sequence_kernels)
from treecompile.capture.drop_ins import class_swaps
from treecompile.capture.torch_swaps import imported_torch_swaps
from treecompile.core.padded_rows import batch_from_rows, normalised
from treecompile.core.errors import (BatchRefused, CaptureFailed, ConstantLength, TreeInputError, UnsupportedModelError,
                                     about_sizes)
from treecompile.capture.hf_interfaces import MaskRead, check_unset, refuse_label_smoothing, uses_attention_interface
from treecompile.passes import markers  # noqa: F401 (registers the treecompile:: ops)
from treecompile.passes.conv_context import NeedsStructure
from treecompile.capture.router_aux import router_aux_of
from treecompile.passes.pipeline import PASSES, CallState, CompileRecord, JudgedInputChanged, passes_for
from treecompile.passes.verify import HeldAtRowCount
from treecompile.compile.delegating import DelegatingModule
from treecompile.compile.entry import CALLS, one_at_a_time, warn_outer_compile
from treecompile.compile.length_check import forget_pending, judge_length_branches
from treecompile.compile.tree_call import WholeTreeCall
from treecompile.compile.model_checks import EXPECTED, check_model, check_sharded
from treecompile.compile.options import BACKENDS, MASKS, OUTPUTS, Verify, checked_options
from treecompile.distributed.unsharded import fsdp_call_of
from treecompile.compile.probe import ProbeRefused, ProbeReport, probe_new_graphs
from treecompile.compile.selfcheck import VerifyReport, verify_tree_compile

if TYPE_CHECKING:
    from treecompile.stream.options import StreamOptions

__all__ = [
    "tree_compile", "TreeCompiledModel", "TreeOutput", "VerifyReport", "verify_tree_compile", "MASKS", "BACKENDS",
    "OUTPUTS", "Verify",
]

#: Fewest rows a compiled call runs (shorter batches are padded; see `TreeBatch.padded`).
MIN_ROWS = 2


def tree_compile(
    model: nn.Module,
    *,
    mask: str = "interval",
    backend: str | None = None,
    verify: bool | str | Verify = "probe",
    outputs: tuple[str, ...] = (),
    lm_head: str = "gather",
    temperature: float = 1.0,
    disable_passes: tuple[str, ...] = (),
    stream: StreamOptions | None = None,
    scan_kernel: str = "auto",
    dropout: str = "refuse",
    cp: Any = None,
) -> TreeCompiledModel:
    """Wraps a causal LM so that it trains on packed tree batches exactly.

    Args:
        model: a Hugging Face causal LM or any module ``model(ids[1, S]) -> logits`` (a
            tensor, a tuple starting with logits, or an object with ``.logits``); FSDP2-sharded
            too (each call unsharded, `treecompile.distributed.unsharded.UnshardedUntilBackward`).
        mask: ``"interval"`` (``subtree_end``, default) or ``"bitmask"`` (``path_bits``;
            pack with ``path_bits=True``).
        backend: ``"aot_eager"``, ``"inductor"`` or ``"eager"``; None picks inductor on
            CUDA and aot_eager on CPU.
        verify: ``"probe"`` (default): on the first call and after every recompile, run
            the rewritten graph on a small forest from the batch's tokens, with one branch
            changed (rows outside it must not change) and one path alone (its rows must
            match); a mismatch refuses the model naming the first op whose rows differ
            (:mod:`treecompile.compile.probe`). ``True``: the probe, and on the first call the full
            check: a small random tree against the unmodified model run on each path, loss
            and every parameter's gradient, in float64 on a CPU copy of the model (or, for a
            model over 2 GiB in float64, on the model itself in its dtype), raising
            `UnsupportedModelError` naming the parameter that differs most; with
            ``stream``, the first streamed call also checks the streamed variant, on that
            tree cut into parts (`TreeCompiledModel.stream_verified`). ``False``: neither.
        outputs: extra per-row outputs: ``("entropy",)`` adds `TreeOutput.entropy`, the
            entropy of each target's predicting distribution (differentiable, for entropy
            bonuses; the vocabulary projection then runs on every predicting row).
        lm_head: ``"gather"`` (default): the LM head runs on the predicting rows only;
            ``"fused"``: a plain LM head (a ``linear``) is fused with the log-softmax and
            computed in row chunks, forward and backward, so the ``[rows, vocab]`` logits are
            never formed (other heads, e.g. with final soft-capping, fall back to gather).
            It saves memory, not time: 3.4x to 3.8x slower steps on an H100 (docs/benchmarks.md).
        temperature: the logits are divided by it before the log-softmax and the entropy,
            as a sampler and RL trainers (TRL's GRPO) do; 1 leaves them as they are.
        disable_passes: names of passes not to run (``"rewrite_positions_pass"`` ...), to find
            which rewrite a model needs; the verification still refuses a graph left inexact.
        stream: a :class:`~treecompile.stream.options.StreamOptions`: a batch with more rows than
            its ``budget_rows`` (or whose step does not fit its ``budget_bytes``) runs in
            parts with a KV stack (:mod:`treecompile.stream.options`);
            smaller batches are unchanged. None: every batch runs as one call.
        scan_kernel: what runs the Gated DeltaNet / Mamba2 scans of a hybrid model on the
            tree: ``"auto"`` (default: flash-linear-attention's kernels on CUDA when they are
            installed and pass a check against the torch scan, else the torch scan),
            ``"torch"`` or ``"fla"`` (raises at the first call where it cannot be used);
            see :data:`treecompile.kernels.scans.recurrence.SCAN_KERNELS`.
        dropout: dropout outside attention in training mode draws one mask per path in
            per-path training and one per tree row here (a shared prefix token is dropped or
            kept for all its paths): another estimator of the same expectation, not the same
            numbers. ``"refuse"`` (default) refuses it (train with ``model.eval()`` or dropout 0);
            ``"shared"`` trains with it. Attention dropout is refused either way.
        cp: context parallelism: a ``torch.distributed`` process group (or a 1-D
            ``DeviceMesh``) whose ranks each call the wrapper with the same batch; each runs
            its share of the packed row (split by work), the attention layers gather the keys
            and values their queries see from the other ranks, and every rank gets the whole
            tree's loss, log-probabilities and gradients (:mod:`treecompile.distributed.context_parallel`).
            Models with recurrent or convolution layers are refused under it. With ``stream``
            (``budget_rows``: the rows one rank holds; ``budget_bytes``: one rank's step), a
            batch over the budget streams, each part split over the group
            (:mod:`treecompile.distributed.stream_cp`). None: no CP.

    Returns:
        A :class:`TreeCompiledModel` sharing ``model``'s parameters.

    Raises:
        ValueError: an unknown ``mask``, ``backend``, ``lm_head``, ``scan_kernel``, ``dropout`` or pass name.
        UnsupportedModelError: (at the first call) the model mixes the sequence in a way
            that cannot be made exact on a tree; the message names the op and source line.
            (Here already) a Hugging Face MoE model's router auxiliary loss cannot be counted
            per path (see :func:`treecompile.capture.router_aux.router_aux_of`).
    """
    if isinstance(model, TreeCompiledModel):
        raise TypeError(f"{EXPECTED}; got a model that is already tree-compiled (pass its .model)")
    check_model(model)
    verify = checked_options(mask=mask, backend=backend, outputs=outputs, temperature=temperature,
                             scan_kernel=scan_kernel, dropout=dropout, verify=verify)
    passes = passes_for(lm_head, disable_passes=disable_passes)
    if stream is not None:
        from treecompile.stream.options import StreamOptions

        if not isinstance(stream, StreamOptions):
            raise TypeError(f"stream must be a treecompile.stream.options.StreamOptions, got {type(stream).__name__}")
    check_sharded(model, full_check=verify is Verify.FULL)
    if cp is not None:
        from treecompile.distributed.context_parallel import cp_group_checked

        cp = cp_group_checked(cp, mask=mask, full_check=verify is Verify.FULL)
    return TreeCompiledModel(
        model, mask=mask, backend=backend, verify=verify, outputs=tuple(outputs), passes=passes,
        temperature=float(temperature), scan_kernel=scan_kernel, stream=stream, dropout=dropout, cp=cp,
    )


class TreeCompiledModel(WholeTreeCall, DelegatingModule):
    """A causal LM that takes a :class:`~treecompile.TreeBatch` and returns a :class:`TreeOutput`.

    The wrapped model is not registered as a submodule: ``parameters()``,
    ``state_dict()``, ``load_state_dict()``, ``train()``, ``to()`` and attribute access
    go straight to it, so optimizers, checkpoints and keys are unchanged (no prefix).

    Attributes:
        mask: the mask encoding, ``"interval"`` or ``"bitmask"``.
        verify: a `Verify` (see `tree_compile`).
        verified: the report of the full check (``verify=True``) once it has run, else None.
        probed: the report of the probe of each compiled graph (``verify`` not False).
        stream_verified: with ``stream=``, the report of the check of the streamed variant,
            run at the first streamed call (its ``stream`` holds the check run's parts).
        compile_records: one :class:`~treecompile.passes.pipeline.CompileRecord` per
            (re)compile, with the per-pass rewrite counters.
        scan_kernel, dropout: as `tree_compile` took them.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        mask: str,
        backend: str | None,
        verify: Verify | bool | str,
        passes: tuple = PASSES,
        outputs: tuple[str, ...] = (),
        temperature: float = 1.0,
        scan_kernel: str = "auto",
        stream: StreamOptions | None = None,
        dropout: str = "refuse",
        cp: Any = None,
    ) -> None:
        super().__init__()
        object.__setattr__(self, "_inner", model)
        self.training = model.training
        self.mask = mask
        self.verify = Verify.of(verify)
        self._backend_name = backend
        self.compile_records: list[CompileRecord] = []
        # The batch's layout, chunks and judging lengths, read by the backend when a graph compiles.
        self._state = CallState()
        self._is_hf = is_hf_model(model)
        # Hugging Face attention-interface calls become tree markers and their masks TreeMasks; a model
        # whose attention is its own code reads Hugging Face's masks, built as eagerly (`eager_mask_skips`).
        routes = self._is_hf and uses_attention_interface(model)
        self._route = AttentionRoute(routes, mask_builder_swaps(model) if routes else
                                     eager_mask_skips() if self._is_hf else [])
        # The router aux loss the model adds (config.output_router_logits, router_aux_loss_coef), read once.
        self._router_aux = router_aux_of(model) if self._is_hf else None
        scans = sequence_kernels(model)  # swapped for treecompile ops during each call (hybrid models)
        # Whether the passes need the path structure: scan kernels or convolutions over the sequence.
        self._structure = bool(scans) or any(isinstance(m, nn.Conv1d) for m in model.modules())
        self._kernels = scans + class_swaps(model) + imported_torch_swaps(model)  # classes, torch names: likewise
        self._call_kwargs = call_kwargs(model, self._is_hf, self._router_aux)
        self._compiled = None
        self._first_record = 0
        self._proven_rows: int | None = None
        self._last_rows, self._away = 0, False  # the rows the last call ran; whether to run others (_forward_tree)
        self._extending = False  # whether short buffers are extended for each call (see _tree_call)
        self._call_batch: TreeBatch | None = None  # the batch of the call running, for the probe
        self._passes = passes
        self._outputs = outputs
        self.temperature = temperature
        self.scan_kernel = scan_kernel
        self.dropout = dropout
        self.verified: VerifyReport | None = None
        self.probed: list[ProbeReport] = []
        self._refused: UnsupportedModelError | None = None  # by the probe: for good (its graph is not run again)
        self.stream_verified: VerifyReport | None = None
        # With stream= (cp=), a StreamRunner (CPRunner) runs batches over its budget (every batch,
        # split over the group) from what it needs, handed over.
        setup = CallSetup(
            model=self._inner, structure=self._structure, passes=self._passes, backend=self._backend,
            graph_parts=self._graph_parts, is_hf=self._is_hf, route=self._route, kernels=self._kernels,
            router_aux=self._router_aux, outputs=self._outputs, compile_records=self.compile_records)
        self._stream_options = stream
        self._runners(setup, cp)
        # An FSDP2 model runs unsharded from each call to the end of its backward (the CP
        # runner runs it unsharded for each call itself).
        self._fsdp = fsdp_call_of(model) if cp is None else None

    def _runners(self, setup: CallSetup, cp: Any) -> None:
        """The stream runner (with ``stream=``) and the CP runner (with ``cp=``, which streams what
        is over the budget itself), none compiled yet."""
        stream = self._stream_options
        self._setup, self._stream, self._cp = setup, None, None
        if cp is not None:
            from treecompile.distributed.stream_cp import cp_runner

            self._cp = cp_runner(setup, cp, stream)
        elif stream is not None:
            from treecompile.stream.runner import StreamRunner

            self._stream = StreamRunner(setup, stream)

    def _keep_own_mask(self) -> None:
        """The model's own code read the attention mask a layer was handed (`MaskRead`): its calls
        keep its attention implementation and Hugging Face's mask from now on
        (`AttentionRoute.read_by_the_model`), compiled again at the next call."""
        self._route.read_by_the_model(eager_mask_skips())
        self._call_kwargs = call_kwargs(self._inner, self._is_hf, self._router_aux, own_attention=True)
        self._compiled = None
        self._runners(self._setup, None if self._cp is None else self._cp.group)

    def _options(self) -> dict[str, Any]:
        """The keyword arguments that wrap a model as this wrapper is (its stream runner aside)."""
        return dict(mask=self.mask, backend=self._backend_name, verify=self.verify, passes=self._passes,
                    outputs=self._outputs, temperature=self.temperature, scan_kernel=self.scan_kernel,
                    dropout=self.dropout)

    def __deepcopy__(self, memo: dict) -> TreeCompiledModel:
        # A copy of the model, wrapped with the same options (compiled again at its first call),
        # as a reference-model copy of a trainer expects.
        cp = None if self._cp is None else self._cp.group  # the copy runs over the same group
        return _rewrap(copy.deepcopy(self._inner, memo), self._options(), self._stream_options, cp)

    def __reduce_ex__(self, protocol: int):
        # The compiled graph and the kernels swapped in around it cannot be pickled: a pickled
        # wrapper is its model and options, wrapped again on loading and compiled at its first
        # call (``pickle``, ``torch.save`` of the whole wrapper).
        if self._cp is not None:
            raise TypeError("a context-parallel TreeCompiledModel holds a process group and cannot be pickled: "
                            "pickle its .model and wrap it again in the loading process")
        return _rewrap, (self._inner, self._options(), self._stream_options)

    @property
    def counters(self) -> dict[str, Counter]:
        """Rewrite counters of the latest compile, per pass (empty before the first call)."""
        return self.compile_records[-1].counters if self.compile_records else {}

    # ------------------------------------------------------------------ forward

    @torch._dynamo.disable(recursive=True)
    def __call__(self, *args: Any, **kwargs: Any) -> TreeOutput:
        # A call swaps module-level functions (Hugging Face's attention interfaces, sequence
        # kernels) for its duration and may compile or judge the model again: calls from
        # several threads run one at a time, in this process, whichever wrapper they are on.
        # It is never traced by an outer torch.compile (`warn_outer_compile`): the call
        # compiles the model itself.
        warn_outer_compile()
        with CALLS:
            return super().__call__(*args, **kwargs)

    #: Hugging Face's ``Trainer`` passes ``num_items_in_batch`` to a model that says it takes it.
    accepts_loss_kwargs = True

    @one_at_a_time  # also when called as .forward, as PEFT's LoraModel calls its base model
    def forward(
        self,
        batch: TreeBatch | None = None,
        *,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        **unset: Any,
    ) -> TreeOutput:
        """Runs the model on a packed tree batch.

        The keyword arguments are Hugging Face's (what its ``Trainer`` passes; see
        :mod:`treecompile.integrations.hf`).

        Args:
            batch: from :func:`treecompile.pack` (or ``TreeCollator``), on the model's device.
            input_ids: ``[B, T]`` instead of ``batch``: a stock collator's padded rows, merged
                into one ``token-mean`` tree (``integrations.hf.batch_from_rows``), so the loss is
                the stock causal-LM loss.
            labels: ``[B, T]`` with ``input_ids``: -100 where a token is not trained. Beside a
                ``batch`` only the labels `treecompile.integrations.hf.TreeCollator` returns
                with it are taken (they are its own targets, which the ``Trainer`` counts);
                any other labels beside a ``batch`` are refused (they would not be read).
            attention_mask: ``[B, T]`` with ``input_ids``: 0 on padding.
            num_items_in_batch: the trained tokens of every micro-batch of the accumulation
                window: a ``token-mean`` batch's summed loss is divided by it instead of by
                its own count, as Hugging Face's causal-LM loss does.
            **unset: Hugging Face's other forward arguments, as wrappers such as PEFT's
                ``PeftModelForCausalLM`` pass them along, accepted while unset
                (``inputs_embeds=None``, ``output_attentions=None``, ...); one that is set is
                refused by name.

        Returns:
            :class:`TreeOutput` with ``loss`` and ``logprobs`` ``[S]``.
        """
        if "transformers.trainer" in sys.modules:
            refuse_label_smoothing()
        check_unset(unset)
        if isinstance(batch, torch.Tensor) and input_ids is None:  # compiled(ids): padded rows, as HF takes them
            batch, input_ids = None, batch
        elif isinstance(input_ids, TreeBatch) and batch is None:  # a wrapper's forward(input_ids=batch)
            batch, input_ids = input_ids, None
        if batch is None and input_ids is not None:
            batch = batch_from_rows(input_ids, labels=labels, attention_mask=attention_mask)
        elif batch is not None and (input_ids is not None or attention_mask is not None):
            raise TreeInputError("pass either a TreeBatch (batch=) or padded rows (input_ids=, attention_mask=), "
                                 "not both")
        elif isinstance(batch, TreeBatch) and labels is not None and not batch.__dict__.get("_labels_beside"):
            # A TreeBatch carries what it trains (its trees' loss masks); labels beside it would be
            # ignored, so they are refused (TreeCollator's own labels are marked as its targets).
            raise TreeInputError(
                "labels= beside a TreeBatch would not be read: the batch trains what its trees' loss masks say. Build "
                "the trees with these masks (TrajectoryTree.from_sequences(..., loss_masks=...), 0 where a label is "
                "-100), or pass the padded rows instead: model(input_ids=..., labels=...)")
        if not isinstance(batch, TreeBatch):
            raise TypeError(f"expected a TreeBatch (treecompile.pack) or input_ids, got {type(batch).__name__}")
        if num_items_in_batch is not None:
            batch = normalised(batch, num_items_in_batch)
        # Every batch is checked before it runs (O(S + N)): a malformed one (two batches
        # concatenated field by field, ids beyond the vocabulary, NaN weights) would otherwise
        # give NaN or silently wrong results, or fail deep inside the compiled graph.
        batch.validate(vocab_size=self._vocab_size)
        # A path longer than the model's context trains exactly as per path, which is itself
        # out of the model's range: say so (once per call site, as warnings do).
        warn_position_overflow(batch, self._inner, stacklevel=2)
        if self._refused is not None:
            raise self._refused
        try:
            try:
                return self._forward(batch)
            except MaskRead as read:
                if not self._route.routes:
                    raise
                self._keep_own_mask()
                try:
                    return self._forward(batch)
                except UnsupportedModelError as e:  # first what kept it off the markers, then why
                    if not isinstance(e, BatchRefused):  # (the model runs with its own mask; not this batch)
                        e.args = (f"{str(read).partition(chr(10))[0]}\n  Captured with Hugging Face's own causal "
                                  f"mask instead, it is refused: {e}",)
                    raise
        except ProbeRefused as e:
            self._refused = e  # its graph stays cached and would not be probed again
            raise

    def _forward(self, batch: TreeBatch) -> TreeOutput:
        """One checked batch: over the CP group, streamed in parts, or as one compiled call; then the
        model's branches on the sequence length a path took the other way for (`judge_length_branches`)."""
        forget_pending(self.compile_records)  # a call that failed leaves no branch to judge to this one
        if self._cp is not None:
            out = self._cp(batch)
        elif self._stream is not None and self._stream.wants(batch):
            out = self._stream(batch)
            if self.verify is Verify.FULL and self.stream_verified is None:  # the streamed variant is checked on its own
                self.stream_verified = verify_tree_compile(self, batch, stream=self._stream.options)
        elif self._fsdp is None:
            out = self._forward_tree(batch)
        else:
            self._fsdp.begin()
            out = None
            try:
                out = self._forward_tree(batch)
            finally:
                self._fsdp.forward_done([] if out is None else [out.loss, out.logprobs, out.aux_loss, out.entropy])
        judge_length_branches(self, batch, out.logprobs)
        return out

    def _forward_tree(self, batch: TreeBatch) -> TreeOutput:
        """The whole tree as one compiled call (``batch`` checked). A model that keeps a table as
        long as this packed row (a cache an earlier call, tree or eager, built at this length:
        `HeldAtRowCount`, or a cached length that made this one a constant) takes its cache-hit
        branch: the batch runs again with a zero-weight row more, and from then on with one more
        whenever its row count is the last call's, so the model builds its table in the call (a
        cache-miss branch). A length made a constant at the first call is refused at once."""
        try:
            return self._tree_call(batch, away=False)
        except ConstantLength as hit:
            if not (isinstance(hit, HeldAtRowCount) or self._last_rows
                    or short_buffers(self._inner, batch.num_tokens, 0, equal=True)):
                raise  # (a length made constant at the first call, with no cache that long: a loop over it)
            self._away = True
            return self._tree_call(batch, away=True)

    def _tree_call(self, batch: TreeBatch, away: bool) -> TreeOutput:
        """One try of `_forward_tree` (``away``: with a zero-weight row more)."""
        if self.mask == "bitmask" and batch.path_bits is None:
            raise TreeInputError("mask='bitmask' needs path bits: pack the batch with pack(..., path_bits=True)")
        device = device_of(self._inner)
        rows = batch.num_tokens
        # Torch specialises a size-1 dimension as a constant (a recompile, the sequence axis blurred with
        # the batch axis): at least 2 rows, and for one target, row or node a zero-weight padding tree.
        longest = batch.longest_path()[0]  # from the batch's check: no read of the device
        if self._proven_rows is not None and longest > self._proven_rows:
            # The graph rests on a judgement made at a shorter length (the model's own mask evaluated
            # there): compile again, judging at twice this length (O(log) recompiles as batches grow).
            self._compiled, self._proven_rows = None, None
            self._state.probe_rows = 2 * longest
        dest, predicting, _ = batch.head_index()
        away = away or self._away and rows == self._last_rows
        batch = batch.padded(max(MIN_ROWS, rows + 1 if away else 0),
                             target=min(dest.shape[0], predicting.shape[0], batch.num_nodes) == 1)
        batch = batch.to(device) if batch.device != device else batch
        args = self._inputs(batch)
        compiled_before = len(self.compile_records)
        if self._compiled is None:
            self._compiled, self._first_record = self._build(device), len(self.compile_records)
        # Buffers sliced by the row count, shorter than the rows but as long as the longest path
        # (nanoGPT's tril[:T, :T]), fail a capture: extended for the call once a capture has failed
        # so (then for every such batch); masks are judged no longer. (Exactly as long: _forward_tree.)
        short = short_buffers(self._inner, batch.num_tokens, longest)

        def extend():
            return short if self._extending else []

        self._call_batch = batch if self.verify.probes else None
        self._state.path_lengths = functools.cache(batch.path_lengths)  # read once per call, by a graph with a length branch
        try:
            try:
                out = self._call(args, extend(), batch.num_tokens, longest)
            except (NeedsStructure, JudgedInputChanged) as again:
                # A shift or a functional conv along the sequence: capture again with the paths. A
                # tensor whose values the passes judged changed (a window set between steps): judge anew.
                if isinstance(again, NeedsStructure):
                    if self._structure:
                        raise
                    self._structure = True
                self._compiled, self._first_record = self._build(device), len(self.compile_records)
                args = self._inputs(batch)
                out = self._call(args, extend(), batch.num_tokens, longest)
        except CaptureFailed as failed:
            error = failed.error
            if not short or self._extending or not about_sizes(error, batch.num_tokens):
                raise error from None  # (about_sizes: not a failure on a tensor's values)
            self._extending = True
            try:
                out = self._call(args, extend(), batch.num_tokens, longest)
            except CaptureFailed as again:  # a failure with the buffers extended
                raise again.error from None
        finally:
            self._call_batch, self._state.path_lengths = None, tuple  # the batch is not kept past the call
        loss, logprobs, aux, entropy = out
        self._last_rows = batch.num_tokens
        bounds = [r.max_rows for r in self.compile_records[self._first_record:] if r.max_rows is not None]
        self._proven_rows = min(bounds) if bounds else None
        out = TreeOutput(
            loss=loss, logprobs=logprobs[:rows], aux_loss=aux, entropy=None if entropy is None else entropy[:rows]
        )
        if self.verify.probes:
            probe_new_graphs(self, self.compile_records[compiled_before:], batch)
        if self.verify is Verify.FULL and self.verified is None:
            self.verified = verify_tree_compile(self, batch)
        return out

    @property
    def _vocab_size(self) -> int | None:
        """The token ids the model takes now (read at each call: ``resize_token_embeddings``
        after wrapping changes it)."""
        return model_vocab_size(self._inner, self._is_hf)


# --------------------------------------------------------------------------- helpers


def _rewrap(model: nn.Module, options: dict[str, Any], stream: StreamOptions | None, cp=None) -> TreeCompiledModel:
    """A pickled (or copied) `TreeCompiledModel`: ``model`` wrapped again with its ``options``."""
    return TreeCompiledModel(model, **options, stream=stream, cp=cp)
