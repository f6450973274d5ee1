"""What every call of a tree-compiled model shares, whole (:mod:`treecompile.compile.wrapper`) or in
streamed parts (:mod:`treecompile.stream.options`): what it returns (`TreeOutput`), the Dynamo
settings it runs under (`DYNAMO_CONFIG`) and the device it runs on (`device_of`).
"""

from __future__ import annotations

import contextlib
import itertools
import types
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from treecompile.passes import markers
from treecompile.core.reference import logits_of

__all__ = ["AttentionRoute", "CallSetup", "TreeOutput", "DYNAMO_CONFIG", "call_settings", "device_of", "gathered_entropy", "run_head",
           "compile_named",
           "argument_names",
           "call_under_setup"]


@dataclass
class TreeOutput:
    """What a tree-compiled model returns.

    Attributes:
        loss: scalar, ``-(target_weight * logprobs).sum()``, plus ``coef * aux_loss`` for a
            model with a router auxiliary loss; backward fills the model's grads.
        logprobs: ``[S]`` log-probability of each row's token given its path prefix,
            aligned with ``target_weight``; 0 where ``pred_index`` is -1.
        aux_loss: scalar router load-balancing loss over all tokens of all paths (each row
            weighted by ``path_count``), unscaled, as per-path training computes it; None for
            a model without one (see :mod:`treecompile.passes.moe`).
        entropy: ``[S]`` entropy of the distribution that predicts each row's token, aligned
            with ``logprobs`` (0 where ``pred_index`` is -1), differentiable; only with
            ``tree_compile(outputs=("entropy",))``, else None.
    """

    loss: torch.Tensor
    logprobs: torch.Tensor
    aux_loss: torch.Tensor | None = None
    entropy: torch.Tensor | None = None

    def __getitem__(self, key: int | slice | str) -> Any:
        """``out[0]`` or ``out["loss"]`` is the loss, as Hugging Face's ``Trainer`` reads a model's
        output; an index or slice reads `to_tuple` (``out[1:]``: the outputs beside the loss)."""
        if isinstance(key, (int, slice)) and not isinstance(key, bool):
            return self.to_tuple()[key]
        if isinstance(key, str) and key in self.__dataclass_fields__:
            return getattr(self, key)
        raise KeyError(f"{key!r}: a TreeOutput has an index, a slice or {', '.join(self.__dataclass_fields__)}")

    def __getattr__(self, name: str) -> Any:
        # Only for names the dataclass does not have: say why ``logits`` is missing (code written
        # for Hugging Face outputs, e.g. a Trainer's ``compute_loss_func``, reads it).
        if name == "logits":
            raise AttributeError(
                "a tree-compiled model returns no logits: the [rows, vocab] logits are never kept (the LM head "
                "gathers each target's log-prob); read .logprobs ([S], aligned with the batch's target_weight), "
                "or tree_compile(outputs=('entropy',)) for the entropy"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def to_tuple(self) -> tuple[torch.Tensor, ...]:
        """The fields that are set, in order (loss first), as Hugging Face's ``ModelOutput.to_tuple``."""
        return tuple(getattr(self, f) for f in self.__dataclass_fields__ if getattr(self, f) is not None)


# Dynamo settings for our calls only:
# - allow_rnn: capture recurrent layers so the verify pass can name them;
# - fail_on_recompile_limit_hit: past the limit Dynamo would run the model uncompiled,
#   i.e. with per-sequence attention on the packed row: silently wrong, so fail instead;
# - recompile_limit: 64 graphs per compiled function, not 8: a model whose cache grows with the
#   longest sequence seen recompiles at each new longest length, in both grad modes, and a
#   training run would reach 8 within a few steps;
# - allow_unspec_int_on_nn_module: a Python int the model counts on itself (``self.step += 1``)
#   becomes a symbol after its first change instead of a constant guarded on, which would
#   compile again at every call (and fail at the limit); see treecompile.passes.state;
# - reorderable_logging_functions: a model's ``warnings.warn(message)`` (torch 2.13's own
#   ``F.multi_head_attention_forward`` warns so about a float ``attn_mask`` beside a boolean
#   padding mask) is issued after the graph runs, as ``print`` is, instead of failing the capture
#   (Dynamo reorders a call with positional constants only: one with a category or keywords is
#   refused naming its line).
DYNAMO_CONFIG = {
    k: v
    for k, v in {"allow_rnn": True, "fail_on_recompile_limit_hit": True, "recompile_limit": 64,
                 "allow_unspec_int_on_nn_module": True,
                 "reorderable_logging_functions": {*torch._dynamo.config.reorderable_logging_functions,
                                                   warnings.warn}}.items()
    if k in torch._dynamo.config._config
}


@contextlib.contextmanager
def call_settings():
    """What every compiled call runs under: no duck shaping (S, M and R must not be assumed equal
    because they once were), `DYNAMO_CONFIG`, the grad mode it found, restored also after an
    error raised between the graph's own switches (a batch refused inside a model's no_grad region),
    and torch's fused fast path of ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` off
    (taken without gradients, it hides the mask and the softmax the passes rewrite)."""
    mha = getattr(torch.backends, "mha", None)
    fast = mha.get_fastpath_enabled() if mha is not None else None
    with torch.fx.experimental._config.patch(use_duck_shape=False), torch._dynamo.config.patch(DYNAMO_CONFIG), \
            torch.set_grad_enabled(torch.is_grad_enabled()):
        if mha is not None:
            mha.set_fastpath_enabled(False)
        try:
            yield
        finally:
            if mha is not None:
                mha.set_fastpath_enabled(fast)


def device_of(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without parameters)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def gathered_entropy(
    logits: torch.Tensor, rows: torch.Tensor, slot: torch.Tensor, dest: torch.Tensor, like: torch.Tensor
) -> torch.Tensor:
    """``[S]`` entropies of the ``R`` predicting rows' distributions, put at each target's row.

    Every op acts along the vocabulary dimension of one row, so the verify pass accepts them.
    """
    z = markers._upcast(logits[0].index_select(0, rows))
    logp = torch.log_softmax(z, dim=-1)
    ent = -(logp.exp() * logp).sum(dim=-1)
    return markers.scatter_to_rows(ent[slot], dest, like.shape[0])


def run_head(inner: nn.Module, kwargs: dict[str, Any], ids: torch.Tensor, positions: torch.Tensor,
             rows: torch.Tensor, slot: torch.Tensor, target: torch.Tensor, dest: torch.Tensor,
             weight: torch.Tensor, temperature: float, want_entropy: bool) -> tuple:
    """Inside a compiled call: the model on the packed ``ids``, then what a call returns from its
    logits. ``(model output, loss, logprobs [S], entropy [S] or None)``; the loss is
    ``-(weight * logprobs).sum()`` (a router's auxiliary loss is the caller's)."""
    out = inner(ids, **kwargs)
    logits = logits_of(out)
    if temperature != 1.0:
        # A row-wise scalar division: the loss pass still gathers before the LM head.
        logits = logits / temperature
    logprobs = torch.ops.treecompile.tree_logprobs(logits, rows, slot, target, dest)
    loss = -(weight.to(logprobs.dtype) * logprobs).sum()
    entropy = gathered_entropy(logits, rows, slot, dest, positions) if want_entropy else None
    return out, loss, logprobs, entropy


_GRAPH_NUMBERS = itertools.count()
#: The names `compile_named` gave (what `recompile_limit_refusal` reads Dynamo's guard failures of).
_COMPILED_NAMES: set[str] = set()


def recompile_limit_refusal(exc: BaseException):
    """The refusal of a call Dynamo would compile once more than its limit allows
    (``FailOnRecompileLimitHit``), naming the latest guards that failed for the treecompile graph
    that recompiled most; None for any other error."""
    if type(exc).__name__ != "FailOnRecompileLimitHit":
        return None
    import torch._dynamo.utils

    from treecompile.core.errors import UnsupportedModelError

    ours = [f for code, f in list(torch._dynamo.utils.guard_failures.items())
            if getattr(code, "co_name", None) in _COMPILED_NAMES]
    failures = max(ours, key=len, default=[])
    said = "; ".join(str(f).strip().splitlines()[0][:200] for f in failures[-3:]) or "unknown"
    return UnsupportedModelError(
        f"treecompile cannot capture this model: its graph would be compiled again after "
        f"{torch._dynamo.config.recompile_limit} compiles (Dynamo's limit), each because a guard failed: the model "
        "changes between calls something the graph holds fixed (a buffer registered again at each call, a value "
        f"kept in a dict or a global, a tensor's size). The latest guards that failed: {said}.\n"
        "Keep such state as a tensor written in place, or build it in the call; TORCH_LOGS=recompiles shows every "
        "recompile.")


def argument_names(fn: Callable) -> tuple[str, ...]:
    """The names of ``fn``'s arguments: the graph inputs Dynamo takes from them are the batch,
    every other one (reached through the model the function closes over) the model's state."""
    code = fn.__code__
    return code.co_varnames[:code.co_argcount]


def compile_named(fn: Callable, name: str, backend: Callable) -> Callable:
    """``torch.compile(fn)`` under a code object named ``name`` and a number no other call in
    the process gets: Dynamo caches compiled graphs per code object and keeps what it learnt
    about a function's inputs (which sizes and floats vary) per file, line and name, so a name
    of its own per graph keeps wrappers from sharing a recompile budget or another wrapper's
    dynamic inputs (an id would be reused once its wrapper is freed).

    torch.compile keeps every backend it is given in a process-wide table (for
    ``torch._dynamo.reset``); ``backend`` closes over its wrapper, and through it the model,
    so Dynamo gets a weak reference to it and the compiled function the strong one: a wrapper
    that is dropped frees its model, parameters and graphs."""
    code = fn.__code__.replace(co_name=f"{name}_{next(_GRAPH_NUMBERS)}")
    _COMPILED_NAMES.add(code.co_name)
    fn = types.FunctionType(code, fn.__globals__, code.co_name, None, fn.__closure__)
    compiled = torch.compile(fn, backend=_WeakBackend(backend), fullgraph=True)
    compiled._treecompile_backend = backend  # lives as long as the compiled function
    return compiled


class _WeakBackend:
    """A Dynamo backend that calls ``backend`` through a weak reference (see `compile_named`)."""

    def __init__(self, backend: Callable) -> None:
        self._backend = weakref.ref(backend)
        self.__name__ = getattr(backend, "__name__", "treecompile_backend")

    def __call__(self, gm, example_inputs):
        # Alive: Dynamo calls it only inside a call of the compiled function, which holds it.
        return self._backend()(gm, example_inputs)


@dataclass
class AttentionRoute:
    """How a Hugging Face model's attention reaches the passes, one object shared by every
    runner of a wrapper (whole tree, streamed, CP).

    Attributes:
        routes: its attention-interface calls become tree markers and the masks its
            ``masking_utils`` builders return become `treecompile.capture.hf_interfaces.TreeMask`
            objects (`mask_swaps`); False for a model that computes attention in its own code,
            and for one whose own code reads the mask it is handed (`read_by_the_model`).
        mask_swaps: the ``masking_utils`` functions swapped in for a call: the `TreeMask`
            builders, or (not ``routes``) the test whether SDPA's causal mask is skipped, deciding
            as outside a capture (`treecompile.capture.dynamo.eager_mask_skips`).
    """

    routes: bool
    mask_swaps: list

    def read_by_the_model(self, swaps: list) -> None:
        """The model's own code reads the attention mask (Doge's dynamic mask adds a gate per key
        to it, a sparse-attention indexer slices it): from now on its calls keep its attention
        implementation and Hugging Face's own causal mask, built from sizes alone, which the
        attention pass judges by evaluating it, as for a model with its own attention code;
        ``swaps`` make the mask builders decide as they do outside a capture
        (`treecompile.capture.dynamo.eager_mask_skips`)."""
        self.routes, self.mask_swaps = False, list(swaps)


@dataclass(frozen=True)
class CallSetup:
    """What a streamed call takes from its `TreeCompiledModel`, handed over as one object
    (`treecompile.stream.runner.StreamRunner`), all fixed when the wrapper is built.

    Attributes:
        model: the wrapped model.
        structure: whether the model has recurrent or convolution layers (the calls pass the
            path structure).
        passes: the `treecompile.passes.pipeline.Pipeline` (or pass tuple) of the wrapper.
        backend: ``backend(device, *, mask, state, passes, ...)`` (``state``: the caller's
            `treecompile.passes.pipeline.CallState`, set before each call): the
            treecompile Dynamo backend for a graph.
        graph_parts: ``() -> (inner, kwargs_of, router, want_entropy, temperature)``: what the
            traced forward calls.
        is_hf: a Hugging Face model.
        route: how its attention reaches the passes (`AttentionRoute`, shared with the wrapper).
        kernels: sequence kernels swapped in for the call (`treecompile.capture.dynamo`).
        router_aux: the model's router auxiliary loss (`treecompile.capture.router_aux`), or None.
        outputs: extra per-row outputs asked for (``("entropy",)``).
        compile_records: the wrapper's list of compile records (appended to as graphs compile).
    """

    model: Any
    structure: bool
    passes: Any
    backend: Callable
    graph_parts: Callable
    is_hf: bool
    route: AttentionRoute
    kernels: Sequence
    router_aux: Any
    outputs: Sequence[str]
    compile_records: list


def during_capture(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while Dynamo captured a frame (traced it, or compiled its
    graph), not while the compiled code ran."""
    import os

    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(os.path.join("_dynamo", "convert_frame.py")):
            return True
        tb = tb.tb_next
    return False


def failed_capture(exc: BaseException, passing: tuple = ()) -> bool:
    """Whether ``exc`` is a failure to capture the model, refused with the message condensed to
    what failed, where and why: Dynamo's own (a graph break or data-dependent control flow would
    run part of the model outside the rewritten graph), or raised while Dynamo traced or compiled
    a frame (FakeTensor errors, a guard on a data-dependent size, exceptions in the model's code).
    Not a refusal already (`UnsupportedModelError`, or a type in ``passing``), nor an error of the
    compiled code itself, which is the model's."""
    from treecompile.core.errors import UnsupportedModelError

    return not isinstance(exc, (UnsupportedModelError, *passing)) and (
        isinstance(exc, torch._dynamo.exc.TorchDynamoException) or during_capture(exc))


def compile_failure(exc: torch._dynamo.exc.BackendCompilerFailed, passing: tuple = ()) -> BaseException:
    """What a failure of treecompile's backend reaches the caller as: its own refusal (or a
    type in ``passing``) as itself; any other error, of the lowering after the passes, as a
    refusal that says so (`unexpected_error`)."""
    from treecompile.core.errors import UnsupportedModelError, unexpected_error

    inner = exc.inner_exception
    if isinstance(inner, (UnsupportedModelError, *passing)):
        return inner
    return unexpected_error(inner, "lowering the rewritten graph")


def call_under_setup(setup: CallSetup, compiled: Callable, args: tuple, passing: tuple = ()) -> Any:
    """``compiled(*args)`` under ``setup``'s swaps (Hugging Face's interfaces, the sequence
    kernels and mask builders) and Dynamo settings: what a streamed part's or a CP rank's call
    runs in. A refusal of the passes (`UnsupportedModelError`, or a type in ``passing``)
    reaches the caller as itself, not wrapped by Dynamo."""
    import contextlib

    from treecompile.capture.dynamo import hf_interfaces, swapped_kernels
    from treecompile.capture.torch_swaps import TORCH_SWAPS

    hf = hf_interfaces(setup.model, setup.route.routes) if setup.is_hf else contextlib.nullcontext()
    with hf, swapped_kernels([*setup.kernels, *setup.route.mask_swaps, *TORCH_SWAPS]):
        with call_settings():
            try:
                return compiled(*args)
            except torch._dynamo.exc.BackendCompilerFailed as e:
                failure = compile_failure(e, passing)
                raise failure from (failure.__cause__ if failure is e.inner_exception else e.inner_exception)
            except Exception as e:
                if not failed_capture(e, passing):
                    raise
                from treecompile.core.errors import capture_error

                raise recompile_limit_refusal(e) or capture_error(e) from None
