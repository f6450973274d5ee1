"""From a memory budget to a token capacity C: a cost model of one training step.

Example:
    >>> from treecompile.planning.budget import CostModel
    >>> cfg = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    ...            num_attention_heads=32, num_key_value_heads=8, head_dim=128, qk_norm=True)
    >>> cost = CostModel.from_config(cfg, dtype="bfloat16", checkpointing="layer", optimizer="adamw",
    ...                              device="cuda")
    >>> cost.capacity(140e9)  # tokens per part / micro-batch: treecompile.planning.partition's C
    30224

The model is a polynomial in the packed length ``S``, built with sympy::

    peak(S) = static + saved(S) + max(branch_1(S), branch_2(S), ...)

* **static**: parameters, gradients and optimizer state (``OptimizerSpec``), all live for
  the whole step. Gradients are counted in full although they appear during backward, as
  the activations are freed: an upper bound by at most one gradient copy.
* **saved(S)**: what autograd keeps from forward to backward for every decoder layer
  (`layer_terms`), or with activation checkpointing only each layer's input plus one
  layer's recomputed activations.
* **branches**: transients that never overlap, so only the largest counts: the loss head
  (treecompile gathers the ``R <= S`` predicting rows before the LM head, so logits are
  ``[R, V]``; its saved log-probabilities are freed before the first layer's backward),
  the attention backward's working memory at the last and at the first layer, the end of
  the backward, and the optimizer step's temporary. The compiled backward returns every
  parameter's gradient at its end, so the gradients it has computed stay alive as it goes
  down the layers while the activations it is done with are freed: at the last layer's
  attention backward, every layer's saved tensors but that layer's MLP's and the head's and
  one layer's gradients; at the first layer's, that layer's attention's saved tensors and
  every gradient but the input embedding's. The sum is linear in the layer in between, so
  the two ends bound it; the second bounds short steps and streamed parts. With tied
  embeddings the backward's end also holds the shared matrix's two gradients (the head's
  and the input embedding's) besides their sum.

Attention working memory depends on the device. FlexAttention's GPU kernel keeps only
``O(S * heads)`` statistics. On CPU, treecompile runs its own block-sparse op
(`treecompile.kernels.attention.cpu_attention`, ``attention="cpu-blocks"``, the CPU default), which
calls SDPA's fused CPU kernel on up to `CPU_CALL_ROWS` queries at a time: no ``[H, S, S]`` and
no per-head score tensor. A masked call takes at most `CPU_CALL_ROWS` keys, so its additive
tree mask, with its boolean temporaries, is at most ``[CPU_CALL_ROWS, min(S, CPU_CALL_ROWS)]``
(a polynomial in S counts it as ``[CPU_CALL_ROWS, S]``: loose above 512 tokens, by a few MB; a
streamed part's is counted exactly); the rest that grows with S is a call's gathered keys and
values and their gradients, ``[Hkv, live keys <= S, d]`` each. Not counted: the fused kernel's
per-thread buffers (a constant: a few ``[256, 512]`` float32 tiles per thread), and an ALiBi
bias (``[H, rows, keys]``; the models this cost model describes have none).
``attention="flex-dense"`` models the eager (math) flex op treecompile ran on CPU before:
``[H, S, S]`` scores in float32 (float64 for float64 inputs), its backward holding
`CPU_FLEX_SCORE_COPIES` of them at once (torch 2.13).

Accuracy (``tests/test_budget.py``, measured with `measure_peak_bytes`, float32 Qwen3
and Llama configs on CPU, no checkpointing, one gradient-accumulation micro-step plus
AdamW's step): the prediction is never below the measured peak; +0.2% to +4% above it
where layers or the loss head dominate, +7% to +10% where the CPU attention does (its masked
call counted as ``[512, S]``; +48% at S = 1024 with checkpointing, on a model of a few MB).
The CPU attention's working memory alone (one call, forward and backward, on a path or a
branchy tree of 2,048 tokens) measured a third of the two attention-call terms or less. See
``docs/partitioning.md`` for the tables (checkpointing and bfloat16 too). Not measured:
GPUs (Inductor recomputes cheap pointwise ops in backward, so the saved terms should be an
upper bound there).

Every dimension is a sympy symbol until `CostModel.peak_bytes` substitutes the config,
so `CostModel.explain` prints the formula term by term and `CostModel.capacity` solves
``peak(S) <= budget`` exactly: each branch is a polynomial in S with integer
coefficients, increasing for S >= 1, so its largest integer solution is the floor of
its one positive real root, checked in exact arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sympy as sp

from treecompile.planning.model_dims import BudgetError, ModelDims, dims_of
from treecompile.planning.peak_memory import measure_peak_bytes
from treecompile.core.errors import unknown_choice

__all__ = [
    "CHECKPOINTING",
    "ATTENTION",
    "CPU_BLOCK_ROWS",
    "CPU_CALL_ROWS",
    "CPU_FLEX_SCORE_COPIES",
    "DEFAULT_ATTENTION",
    "DEVICES",
    "DTYPE_BYTES",
    "OPTIMIZERS",
    "BudgetError",
    "CostModel",
    "ModelDims",
    "OptimizerSpec",
    "measure_peak_bytes",
]

#: Bytes per element of the dtypes the model accepts.
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
#: ``checkpointing=``: none, or every decoder layer recomputed in backward from its input.
CHECKPOINTING = ("none", "layer")
#: ``device=``: where the step runs.
DEVICES = ("cpu", "cuda")
#: ``attention=``: the attention kernel, which decides the working memory of its backward.
#: ``"flex"``: FlexAttention's fused GPU kernel, ``O(S * H)`` statistics; ``"cpu-blocks"``:
#: treecompile's block-sparse CPU op (``treecompile.kernels.attention.cpu_attention``), SDPA's fused kernel
#: on a few query blocks and their live keys at a time; ``"flex-dense"``: the eager flex op,
#: ``[H, S, S]`` scores (treecompile's CPU path before ``cpu-blocks``).
ATTENTION = ("flex", "cpu-blocks", "flex-dense")
#: The kernel treecompile runs on each device.
DEFAULT_ATTENTION = {"cuda": "flex", "cpu": "cpu-blocks"}
#: Query rows per block of the CPU op (``treecompile.kernels.attention.flex.BLOCK_SIZE``; a test checks).
CPU_BLOCK_ROWS = 128
#: Query rows per call of the CPU op to SDPA's fused kernel (consecutive blocks whose keys
#: nearly agree share one: ``treecompile.kernels.attention.cpu_attention._GROUP_ROWS``), and the most keys
#: of one masked call (``_MASKED_KEYS``); a test checks both.
CPU_CALL_ROWS = 512
#: Bytes per (query, key) pair of a CPU call's tree mask beyond the mask's own dtype: the rule's
#: boolean result and its negation.
_CPU_MASK_BOOL_BYTES = 2
#: ``[H, S, S]`` score-sized tensors alive at once in the eager flex backward (torch 2.13,
#: ``sdpa_dense_backward``: scores, masked scores, probabilities, their gradient and the
#: temporaries between them). Measured: the S^2 coefficient of the peak of a float32 step
#: fitted over S = 256..1024 is 7.06 copies of H*S^2 float32.
CPU_FLEX_SCORE_COPIES = 7


@dataclass(frozen=True)
class OptimizerSpec:
    """Optimizer memory per parameter.

    Attributes:
        name: for messages.
        states: state tensors per parameter (AdamW: 2, SGD with momentum: 1, SGD: 0).
        state_dtype: dtype of the states; None means the parameters' dtype (what
            ``torch.optim`` does).
        master_weights: an extra float32 copy of the parameters (mixed precision).
        step_temporaries: parameter-sized temporaries during ``step()`` (the foreach
            AdamW step computes ``sqrt(exp_avg_sq)`` for all parameters at once: 1).
    """

    name: str
    states: int
    state_dtype: str | None = None
    master_weights: bool = False
    step_temporaries: int = 0


#: Named optimizers for ``optimizer=``.
OPTIMIZERS = {
    "adamw": OptimizerSpec("adamw", states=2, step_temporaries=1),
    "adamw-fp32": OptimizerSpec("adamw-fp32", states=2, state_dtype="float32", master_weights=True,
                                step_temporaries=1),
    "sgd": OptimizerSpec("sgd", states=0),
    "sgd-momentum": OptimizerSpec("sgd-momentum", states=1),
    "none": OptimizerSpec("none", states=0),
}


#: The attention backward's terms, over its key rows (`CostModel.part_bytes`).
_ATTENTION_TERMS = ("attention backward", "call mask", "call keys", "attention scores")

# Symbols: S packed tokens; the rest are the config's dimensions and element sizes.
S = sp.Symbol("S", positive=True, integer=True)
_L, _h, _I, _H, _K, _d, _V = sp.symbols("L h I H K d V", positive=True, integer=True)
_b, _w = sp.symbols("b w", positive=True, integer=True)  # bytes: parameter dtype, working precision
_P, _s = sp.symbols("P s", positive=True, integer=True)  # parameters, optimizer state bytes


@dataclass(frozen=True)
class Term:
    """One named term of the formula: ``bytes`` is a sympy expression."""

    name: str
    bytes: sp.Expr
    why: str


def layer_terms(qk_norm: bool) -> list[Term]:
    """Bytes autograd saves per token for one decoder layer (pre-norm attention + gated MLP).

    ``w`` is the working precision of norms and softmax statistics (float32, or float64
    for float64 models): an RMSNorm upcasts its input and saves that copy. Measured per
    layer on a float32 Qwen3 config (saved-tensor hooks on the compiled step): 4,400
    bytes per token for h=64, H*d=64, K*d=32, I=160, which these terms give exactly.
    """
    terms = [
        Term("attention norm", _h * _w + _w + _h * _b, "input upcast [S, h], rstd [S], output [S, h]"),
        Term("q, k, v", (_H * _d + 2 * _K * _d) * _b, "after RoPE: the attention inputs"),
    ]
    if qk_norm:
        terms.append(Term("q/k norm", (_H * _d + _K * _d) * _b + (_H + _K) * _w, "q, k before the norm, rstd"))
    terms += [
        Term("attention output", 2 * _H * _d * _b + _H * _w, "[H, S, d] for the flex backward, "
             "[S, H*d] for o_proj, logsumexp [H, S]"),
        Term("MLP norm", _h * _w + _w + _h * _b, "input (the residual stream), rstd, output"),
        Term("MLP", 3 * _I * _b, "gate, up and act(gate) * up, each [S, I]"),
    ]
    return terms


@dataclass(frozen=True)
class Branch:
    """Transient memory of one phase of the step; phases do not overlap, the largest counts.

    Attributes:
        name: the phase.
        terms: its bytes.
        with_saved: whether the saved activations are still live then (not for the
            optimizer step, which runs after backward has freed them).
    """

    name: str
    terms: list[Term]
    with_saved: bool = True


@dataclass
class CostModel:
    """Peak memory of one training step as a function of the packed length S.

    Build it with `CostModel.from_config`. Attributes are the inputs; the formula lives
    in `static`, `saved` and `branches` (sympy expressions over the dimension symbols).
    """

    dims: ModelDims
    dtype: str
    checkpointing: str
    optimizer: OptimizerSpec
    device: str
    attention: str
    static: list[Term] = field(init=False)
    saved: list[Term] = field(init=False)
    branches: list[Branch] = field(init=False)
    _numeric_cache: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_choice("dtype", self.dtype, DTYPE_BYTES)
        _check_choice("checkpointing", self.checkpointing, CHECKPOINTING)
        _check_choice("device", self.device, DEVICES)
        _check_choice("attention", self.attention, ATTENTION)
        opt = self.optimizer
        self.static = [
            Term("parameters", _P * _b, "P parameters"),
            Term("gradients", _P * _b, "counted in full (they appear as activations are freed)"),
        ]
        if opt.states:
            self.static.append(Term(f"{opt.name} state", opt.states * _P * _s, f"{opt.states} per parameter"))
        if opt.master_weights:
            self.static.append(Term("master weights", 4 * _P, "float32 copy of the parameters"))

        layer = layer_terms(self.dims.qk_norm)
        per_layer = _total(layer)
        layer_input = _h * _b
        inputs = Term("inputs", (6 * 8 + 2 * _d * _w) * S, "ids, positions, target indices (int64), RoPE cos/sin")
        if self.checkpointing == "none":
            self.saved = [Term("layers", _L * per_layer * S, "per layer: " + ", ".join(t.name for t in layer)), inputs]
        else:
            self.saved = [
                Term("layer inputs", _L * layer_input * S, "one [S, h] checkpoint per layer"),
                Term("recomputed layer", per_layer * S, "one layer's saved tensors during its backward"),
                inputs,
            ]
        head = [
            Term("final norm", (_h * _w + _w + 2 * _h * _b) * S, "input, rstd, normalized and output rows"),
            Term("gathered rows", _h * _b * S, "the [R, h] predicting rows the LM head reads"),
            Term("log-probabilities", _V * _w * S, "[R, V] log_softmax output, R <= S predicting rows"),
            Term("head backward", (2 * _V * _w + (_V * _b if self.dtype_bytes != self.working_bytes else 0)) * S,
                 "gradients of log-probabilities and logits [R, V]" + (", cast to the parameter dtype"
                                                                      if self.dtype_bytes != self.working_bytes else "")),
        ]
        if self.checkpointing != "none":
            # The last layer is recomputed in its own backward, after the head's: the head runs
            # beside the layer inputs alone.
            head.append(Term("no recomputed layer", -per_layer * S, "recomputed after the head's backward"))
        grads = (_H * _w + (2 * _H * _d + 2 * _K * _d) * _b) * S
        if self.attention == "flex":
            attn = [Term("attention backward", grads, "flex kernel: delta [H, S], dO, dq, dk, dv")]
        elif self.attention == "cpu-blocks":
            attn = [
                Term("attention backward", grads, "delta [H, S], dO, dq, dk, dv"),
                Term("call mask", CPU_CALL_ROWS * (_b + _CPU_MASK_BOOL_BYTES) * S,
                     f"the tree mask of one masked fused-kernel call and its booleans: [{CPU_CALL_ROWS}, "
                     f"min(S, {CPU_CALL_ROWS})] at most, counted as [{CPU_CALL_ROWS}, S]"),
                Term("call keys", 4 * _K * _d * _b * S,
                     "one call's gathered keys and values and their gradients, [Hkv, live keys <= S, d] each"),
            ]
        else:
            attn = [Term("attention scores", CPU_FLEX_SCORE_COPIES * _H * _w * S**2,
                         f"eager flex backward: {CPU_FLEX_SCORE_COPIES} x [H, S, S] in working precision")]
        # The compiled backward returns every parameter's gradient at once; with gradient
        # accumulation (parts of one tree) they are then added into the existing .grad.
        # Measured on a float32 6-layer Qwen3 at S=64: this is the step's peak, and the
        # activation gradients alive with it are about 4 [S, h] residual-stream tensors.
        residual = Term("residual gradients", 4 * _h * _w * S, "gradients of the residual stream")
        end = [Term("new gradients", _P * _b, "returned by the compiled backward, before accumulation"), residual,
               inputs]
        if self.dims.tied_embeddings:
            # Measured (CPU): the head's [V, h] gradient, the embedding backward's and their sum
            # are alive together at the end; P counts the shared matrix once.
            end.append(Term("tied embedding gradients", 2 * _V * _h * _b,
                            "the shared matrix's head and input-embedding gradients, before their sum"))
        # The gradients the compiled backward has computed stay alive until it ends, while the
        # activations it is done with are freed: the attention backward is bounded at the last
        # layer (every layer's saved tensors but its MLP's; the head's and one layer's
        # gradients) and at the first (its attention's saved tensors; every gradient but the
        # input embedding's). In between the sum is linear in the layer.
        head_rows = 1 if self.dims.tied_embeddings else 2
        layer_params = (_P - head_rows * _V * _h - _h) / _L
        embedding = 0 if self.dims.tied_embeddings else _V * _h
        last_layer = [*attn, Term("head and layer gradients", (_V * _h + layer_params) * _b,
                                  "the LM head's and the last layer's, computed before its attention backward")]
        if self.checkpointing == "none":
            last_layer.append(Term("last layer MLP", -_total([t for t in layer if t.name == "MLP"]) * S,
                                   "its MLP's saved tensors, freed by its MLP's backward"))
        attention_saved = _total([t for t in layer if not t.name.startswith("MLP")])
        first_layer = [*attn, Term("first layer attention", attention_saved * S,
                                   "its attention's saved tensors (the other layers' and its MLP's are freed)")]
        if self.checkpointing != "none":
            first_layer.append(Term("first layer input", layer_input * S, "its checkpoint (the others are freed)"))
        first_layer += [inputs, Term("gradients so far", (_P - embedding) * _b,
                                     "every parameter's but the input embedding's"), residual]
        self.branches = [Branch("loss head", head), Branch("attention backward", last_layer),
                         Branch("first layer backward", first_layer, with_saved=False),
                         Branch("backward end", end, with_saved=False)]
        if opt.step_temporaries:
            self.branches.append(Branch("optimizer step", [Term(
                "step temporaries", opt.step_temporaries * _P * _s, "parameter-sized; activations are freed by then"
            )], with_saved=False))

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(
        cls,
        config: Any,
        *,
        dtype: str | Any = "bfloat16",
        checkpointing: str = "none",
        optimizer: str | OptimizerSpec = "adamw",
        device: str = "cuda",
        attention: str | None = None,
    ) -> CostModel:
        """A cost model from a Hugging Face config (object or dict) or a `ModelDims`.

        Args:
            config: ``PretrainedConfig``, a dict with the same keys (``vocab_size``,
                ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
                ``num_attention_heads``; optional ``num_key_value_heads``, ``head_dim``,
                ``tie_word_embeddings``, ``attention_bias``, ``mlp_bias``, ``qk_norm``),
                or a `ModelDims`. For a ``PretrainedConfig`` without ``qk_norm``, q/k norms
                are detected on a meta-device instance of the model.
            dtype: parameter and activation dtype (a name in `DTYPE_BYTES` or a torch dtype).
            checkpointing: one of `CHECKPOINTING`.
            optimizer: a name in `OPTIMIZERS` or an `OptimizerSpec`.
            device: one of `DEVICES`.
            attention: one of `ATTENTION`; None picks the kernel treecompile runs on
                ``device`` (`DEFAULT_ATTENTION`).

        Raises:
            BudgetError: a missing key, a mixture-of-experts config, or an unknown option
                (the message lists the valid ones).
        """
        dtype = str(dtype).removeprefix("torch.")
        if isinstance(optimizer, str):
            _check_choice("optimizer", optimizer, OPTIMIZERS)
            optimizer = OPTIMIZERS[optimizer]
        dims = config if isinstance(config, ModelDims) else dims_of(config)
        _check_choice("device", device, DEVICES)
        attention = DEFAULT_ATTENTION[device] if attention is None else attention
        return cls(dims=dims, dtype=dtype, checkpointing=checkpointing, optimizer=optimizer, device=device,
                   attention=attention)

    # ------------------------------------------------------------------ values

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def working_bytes(self) -> int:
        """Bytes of the working precision (norm statistics, softmax): float32, or float64."""
        return max(self.dtype_bytes, 4)

    def _values(self) -> dict[sp.Symbol, int]:
        d = self.dims
        state = self.optimizer.state_dtype
        return {
            _L: d.layers, _h: d.hidden, _I: d.intermediate, _H: d.heads, _K: d.kv_heads, _d: d.head_dim,
            _V: d.vocab, _b: self.dtype_bytes, _w: self.working_bytes, _P: d.num_parameters,
            _s: DTYPE_BYTES[state] if state else self.dtype_bytes,
        }

    def _branch_exprs(self) -> list[sp.Expr]:
        static = _total(self.static)
        return [static + (_total(self.saved) if br.with_saved else 0) + _total(br.terms) for br in self.branches]

    def symbolic(self) -> sp.Expr:
        """``peak(S)`` over the dimension symbols: the ``Max`` over the branches."""
        return sp.Max(*self._branch_exprs())

    def polynomials(self) -> list[sp.Poly]:
        """One integer polynomial in S per branch: ``peak(S)`` is their maximum."""
        vals = self._values()
        return [sp.Poly(sp.expand(e.subs(vals)), S) for e in self._branch_exprs()]

    def peak_bytes(self, tokens: int) -> int:
        """Predicted peak bytes of one step on ``tokens`` packed tokens."""
        if tokens < 1:
            raise BudgetError(f"tokens must be at least 1, got {tokens}")
        return max(int(p.eval(tokens)) for p in self.polynomials())

    def breakdown(self, tokens: int) -> dict[str, int]:
        """Bytes of every term at ``tokens`` (branch terms included, whether or not they win)."""
        vals = {**self._values(), S: tokens}
        terms = [*self.static, *self.saved, *(t for br in self.branches for t in br.terms)]
        return {t.name: int(t.bytes.subs(vals)) for t in terms}

    def part_bytes(self, rows: int, key_rows: int | None = None) -> tuple[int, int]:
        """One streamed part's step above the static memory (`treecompile.stream.plan`):
        ``(saved, transient)``, the bytes its graph keeps for backward over ``rows`` rows and
        the largest branch, with the attention branch over ``key_rows`` keys (its own rows
        plus the prefix it reads; default ``rows``; a CPU attention call has at most
        ``rows`` query rows). A branch that runs without the saved activations (the end of
        backward) counts its own bytes minus the part's saved ones, so ``static + saved +
        transient`` is the part's peak. The optimizer step is not a part's (see
        `optimizer_step_bytes`)."""
        key_rows = rows if key_rows is None else key_rows
        saved_poly, branches = self._numeric()
        saved = _horner(saved_poly, rows)
        best = 0
        for name, with_saved, terms in branches:
            if name == "optimizer step":
                continue
            total = 0
            for term, poly in terms:
                if term not in _ATTENTION_TERMS:
                    total += _horner(poly, rows)
                elif term == "call mask":  # [call rows, keys], each at most CPU_CALL_ROWS
                    total += ((self.dtype_bytes + _CPU_MASK_BOOL_BYTES) * min(rows, CPU_CALL_ROWS)
                              * min(key_rows, CPU_CALL_ROWS))
                else:
                    total += _horner(poly, key_rows)
            best = max(best, total - (0 if with_saved else saved))
        return saved, best

    def head_saved_bytes(self, rows: int) -> int:
        """What the loss head keeps for backward over ``rows`` rows (final norm,
        log-probabilities): freed early in a whole step's backward, but held by a streamed
        part whose backward waits (keep mode)."""
        terms = dict(next(terms for name, _, terms in self._numeric()[1] if name == "loss head"))
        return sum(_horner(terms[t], rows) for t in ("final norm", "log-probabilities"))

    def optimizer_step_bytes(self) -> int:
        """The optimizer step's temporaries (above the static memory), 0 for none."""
        return max((sum(_horner(poly, 1) for _, poly in terms) for name, _, terms in self._numeric()[1]
                    if name == "optimizer step"), default=0)

    def _numeric(self):
        """``saved(S)`` and each branch's terms as integer coefficient lists (constant first),
        cached: `part_bytes` runs once per part in a budget search."""
        if self._numeric_cache is None:
            vals = self._values()

            def coeffs(terms: list[Term]) -> list[int]:
                poly = sp.Poly(sp.expand(_total(terms).subs(vals)), S)
                return [int(c) for c in reversed(poly.all_coeffs())]

            branches = [(br.name, br.with_saved, [(t.name, coeffs([t])) for t in br.terms]) for br in self.branches]
            self._numeric_cache = (coeffs(self.saved), branches)
        return self._numeric_cache

    def static_bytes(self) -> int:
        """Parameters, gradients and optimizer state."""
        vals = self._values()
        return int(_total(self.static).subs(vals))

    def capacity(self, budget_bytes: float) -> int:
        """The largest S with ``peak_bytes(S) <= budget_bytes``.

        Raises:
            BudgetError: not even one token fits; the message gives the static memory.
        """
        budget = sp.Integer(int(budget_bytes))
        if self.peak_bytes(1) > budget:
            raise BudgetError(
                f"a budget of {_gb(budget)} does not fit one token: parameters, gradients and optimizer "
                f"state ({self.optimizer.name}, {self.dtype}) alone need {_gb(self.static_bytes())} for "
                f"{self.dims.num_parameters:,} parameters, and one token needs {_gb(self.peak_bytes(1))} in all"
            )
        best = None
        for poly in self.polynomials():
            roots = [r for r in sp.real_roots(poly - budget) if r > 0]
            # Coefficients are non-negative and the polynomial exceeds the budget at 0 only
            # when S=1 already fails (checked above): exactly one positive root.
            top = int(sp.floor(max(roots))) if roots else None
            if top is None:  # constant branch within budget: no limit from it
                continue
            while poly.eval(top) > budget:  # guard floor() of an algebraic number
                top -= 1
            while poly.eval(top + 1) <= budget:
                top += 1
            best = top if best is None else min(best, top)
        if best is None:
            raise BudgetError("the cost model does not depend on S; every length fits")
        return best

    def explain(self) -> str:
        """The formula, term by term, symbolic and at this config's values."""
        vals = self._values()
        names = {_L: "layers", _h: "hidden", _I: "intermediate", _H: "heads", _K: "kv heads", _d: "head dim",
                 _V: "vocab", _b: "bytes/param dtype", _w: "bytes/working precision", _P: "parameters",
                 _s: "bytes/optimizer state"}
        lines = [
            f"peak(S) = static + saved(S) + max(branches), {self.dtype}, checkpointing={self.checkpointing}, "
            f"optimizer={self.optimizer.name}, device={self.device}, attention={self.attention}",
            "  symbols: " + ", ".join(f"{s}={vals[s]:,} ({n})" for s, n in names.items()),
        ]

        def section(title: str, terms: list[Term]) -> None:
            lines.append(title)
            for t in terms:
                value = sp.expand(t.bytes.subs(vals))
                lines.append(f"  {t.name:24s} {sp.sstr(t.bytes):40s} = {sp.sstr(value):28s} # {t.why}")

        section("static", self.static)
        section("saved for backward", self.saved)
        for br in self.branches:
            live = "static + saved + " if br.with_saved else "static + "
            section(f"branch '{br.name}' ({live}these; the largest branch is the peak)", br.terms)
        lines.append("peak(S) = max(" + ", ".join(sp.sstr(p.as_expr()) for p in self.polynomials()) + ") bytes")
        return "\n".join(lines)


def _total(terms: list[Term]) -> sp.Expr:
    return sum((t.bytes for t in terms), sp.Integer(0))


def _check_choice(what: str, value: str, valid) -> None:
    if value not in valid:
        raise BudgetError(unknown_choice(what, value, valid))


def _horner(coeffs: list[int], x: int) -> int:
    """``sum(c_i x^i)`` for ``coeffs`` constant first."""
    out = 0
    for c in reversed(coeffs):
        out = out * x + c
    return out


def _gb(n: int | sp.Integer) -> str:
    n = int(n)
    return f"{n / 1e9:.3f} GB ({n:,} bytes)" if n >= 1e6 else f"{n:,} bytes"
