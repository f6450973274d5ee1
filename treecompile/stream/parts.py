"""Each streamed part's compiled-call inputs, from the batch's per-row fields: its rows,
targets and visibility over ``[prefix ; own]`` rows, and in a hybrid model the recurrent
state hand-over between parts (its *entry rows* and *readout rows*) and the conv
context's predecessors (see `treecompile.stream.options`)."""

from __future__ import annotations

import numpy as np
import torch

from treecompile.core.batch import TreeBatch, to_device
from treecompile.stream.plan import StreamPlan

__all__ = ["PAD_PREFIX", "PAD_STATES", "BatchArrays"]

#: Rows of the always-invisible padding prefix: the prefix length is never 0 or 1, which
#: Dynamo would specialise (one graph for every part).
PAD_PREFIX = 2
#: Zero states before a part's entry states, and unused readouts before its own, for the
#: same reason (hybrid models).
PAD_STATES = 2


class BatchArrays:
    """The batch's per-row fields as numpy arrays, and each part's compiled-call inputs."""

    def __init__(self, batch: TreeBatch, plan: StreamPlan | None = None, structure: bool = False) -> None:
        self.ids = batch.input_ids.cpu().numpy()
        self.pos = batch.position_ids.cpu().numpy()
        self.sub = batch.subtree_end.cpu().numpy()
        self.weight = batch.target_weight.detach().cpu().numpy()
        self.path_count = batch.path_count.cpu().numpy()
        pred = batch.pred_index.cpu().numpy()
        targets = np.flatnonzero(pred >= 0)
        order = np.argsort(pred[targets], kind="stable")
        self.targets = targets[order]  # target rows, by their predicting row
        self.target_pred = pred[self.targets]
        self.plan = plan
        self.has_structure = structure
        if structure:
            self._state_rows(batch, pred)

    # ---- recurrent state and conv context (hybrid models)

    def _state_rows(self, batch: TreeBatch, pred: np.ndarray) -> None:
        """Per part, its *entry rows* (earlier parts' rows whose recurrent state a row of the
        part starts from: the predecessors of its rows that lie before it) and its *readout
        rows* (its rows that a later part's row starts from), each sorted.

        A readout row is always the last row of its node within the part (the next row on
        its path is a node start or the next part's first row), so the state after it is the
        final state of that node as the part runs it.
        """
        plan = self.plan
        self.pred = pred
        self.n_start, self.n_end, self.n_parent = batch.node_table().numpy().T
        rows = np.flatnonzero(pred >= 0)
        part = plan.part_of(rows)
        src = pred[rows]
        src_part = plan.part_of(src)
        cross = src_part != part
        n = plan.num_parts
        self.entry = [np.unique(src[cross & (part == j)]) for j in range(n)]
        self.readout = [np.unique(src[cross & (src_part == j)]) for j in range(n)]

    def entry_sources(self, j: int) -> list[tuple[int, np.ndarray]]:
        """``(part, readout indices)`` holding part ``j``'s entry rows' states, in entry order."""
        rows = self.entry[j]
        owners = self.plan.part_of(rows)
        out = []
        for q in np.unique(owners).tolist():
            sel = rows[owners == q]
            out.append((q, PAD_STATES + np.searchsorted(self.readout[q], sel)))
        return out

    def structure(self, j: int, dk: int, device) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """``(tree structure, conv_pred, readouts)`` for part ``j``'s call.

        * tree structure (hybrid models): ``[pred_index [S_run], node_table [N, 3]]``, the
          node table (on the CPU) over ``[injection rows ; the part's rows ; readout rows]``
          (see `treecompile.passes.stream.stream_scan_fn`): ``PAD_STATES + E_j`` injection
          nodes of ``dk`` rows (roots), the tree's nodes clipped to the part (a node that
          starts before the part hangs from the injection node of its previous row; one
          whose parent ended before the part, from that of the parent's last row), a root
          node for the padding rows, and ``PAD_STATES + R_j`` readout nodes of ``dk`` rows,
          each a child of the node whose last row it reads;
        * ``conv_pred`` ``[PAD_PREFIX + P_j + S_run]``: each row's predecessor in
          ``[padding ; prefix ; part]`` coordinates (-1 at a root and on padding rows);
        * ``readouts`` ``[PAD_STATES + R_j]``: a tensor whose length is the number of states
          read out.
        """
        plan = self.plan
        a, b = int(plan.starts[j]), int(plan.starts[j + 1])
        s = b - a
        s_run = self.run_rows(a, b)
        prefix = plan.prefix[j]
        n_read = PAD_STATES + (len(self.readout[j]) if self.has_structure else 0)
        readouts = torch.zeros(n_read, dtype=torch.int64, device=device)
        pre = PAD_PREFIX + len(prefix)
        if not self.has_structure:
            return [], torch.full((pre + s_run,), -1, dtype=torch.int64, device=device), readouts
        pred = self.pred[a:b]
        # Predecessors inside the part, before it (on the prefix: index = path position), none.
        before = np.where(pred >= 0, PAD_PREFIX + self.pos[np.maximum(pred, 0)], -1)
        inside = np.where(pred >= a, pre + pred - a, before)
        conv_pred = np.concatenate([np.full(PAD_PREFIX, -1), np.arange(len(prefix)) + PAD_PREFIX - 1, inside,
                                    np.full(s_run - s, -1)])
        if len(prefix):
            conv_pred[PAD_PREFIX] = -1  # the root's first row
        pred_local = np.concatenate([np.where(pred >= a, pred - a, -1), np.full(s_run - s, -1)])
        entry = self.entry[j]
        inj = {int(r): PAD_STATES + i for i, r in enumerate(entry.tolist())}
        n_in = PAD_STATES + len(entry)
        table = [[i * dk, (i + 1) * dk, -1] for i in range(n_in)]
        off = n_in * dk
        v0 = int(np.searchsorted(self.n_start, a, side="right")) - 1
        v1 = int(np.searchsorted(self.n_start, b, side="left"))
        for v in range(v0, v1):
            st, en, par = int(self.n_start[v]), int(self.n_end[v]), int(self.n_parent[v])
            if st < a:
                parent = inj[a - 1]
            elif par < 0:
                parent = -1
            elif par >= v0:
                parent = n_in + par - v0
            else:
                parent = inj[int(self.pred[st])]
            table.append([max(st, a) - a + off, min(en, b) - a + off, parent])
        if s_run > s:
            table.append([off + s, off + s_run, -1])
        off += s_run
        for i in range(PAD_STATES):
            table.append([off + i * dk, off + (i + 1) * dk, 0])
        for i, r in enumerate(self.readout[j].tolist(), start=PAD_STATES):
            v = int(np.searchsorted(self.n_start, r, side="right")) - 1
            table.append([off + i * dk, off + (i + 1) * dk, n_in + v - v0])
        tensors = [to_device(torch.from_numpy(pred_local.astype(np.int64)), device),
                   torch.tensor(table, dtype=torch.int64)]
        return tensors, to_device(torch.from_numpy(conv_pred.astype(np.int64)), device), readouts

    def run_rows(self, a: int, b: int) -> int:
        """``S_run`` of rows ``[a, b)`` (see `part_inputs`)."""
        lo, hi = np.searchsorted(self.target_pred, [a, b])
        return max(b - a, max(int(hi - lo), 2), 2)

    def part_inputs(self, a: int, b: int, prefix: np.ndarray) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The compiled call's inputs for rows ``[a, b)``, and the global rows of its targets.

        The part's targets are those predicted by its rows (the loss needs the predicting
        row's output). A branch row predicts several; the call has ``S_run = max(b - a, M,
        2)`` rows (padding rows see only themselves, nothing sees them) so that the ``M``
        targets' log-probabilities fit in its ``[S_run]`` output, in slots ``0 .. M - 1``.

        ``prefix``: the global rows whose keys and values come before the part's, in row
        order; ``-1`` for a padding key, which no query sees (``PAD_PREFIX`` of them always
        come first).
        """
        s = b - a
        lo, hi = np.searchsorted(self.target_pred, [a, b])
        t = self.targets[lo:hi]
        m = t.shape[0]
        m_run = max(m, 2)
        s_run = max(s, m_run, 2)
        pad = s_run - s
        ids = np.concatenate([self.ids[a:b], np.zeros(pad, np.int64)])
        pos = np.concatenate([self.pos[a:b], np.zeros(pad, np.int64)])
        sub_local = np.concatenate([np.minimum(self.sub[a:b], b) - a, np.arange(s + 1, s_run + 1)])
        rows, slot = np.unique(self.target_pred[lo:hi] - a, return_inverse=True)
        rows = np.concatenate([rows, np.zeros(max(0, 2 - rows.shape[0]), np.int64)])
        target = np.concatenate([self.ids[t], np.zeros(m_run - m, np.int64)])
        slot = np.concatenate([slot.reshape(-1), np.zeros(m_run - m, np.int64)])
        dest = np.arange(m_run)
        weight = np.zeros(s_run)
        weight[:m] = self.weight[t]
        path_count = np.concatenate([self.path_count[a:b], np.zeros(pad, np.int64)])
        p = PAD_PREFIX + prefix.shape[0]
        held = prefix >= 0  # -1: a padding key, which no query sees
        at = np.where(held, prefix, 0)
        kv_end = np.concatenate([np.zeros(PAD_PREFIX, np.int64),
                                 np.where(held, p + np.minimum(self.sub[at], b) - a, 0), p + sub_local])
        kv_pos = np.concatenate([np.zeros(PAD_PREFIX, np.int64), np.where(held, self.pos[at], 0), pos])
        as_t = [torch.from_numpy(np.ascontiguousarray(x)) for x in
                (ids, pos, sub_local, rows, slot, target, dest, weight, path_count, kv_end, kv_pos)]
        as_t = [x.to(torch.int64) if x.dtype != torch.float64 else x for x in as_t]
        return as_t, torch.from_numpy(t.copy())

