"""pytorch/examples word_language_model/model.py ``RNNModel``: torch's recurrent layers as LMs.

An embedding, ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` over the sequence-first input with the
hidden state from ``init_hidden`` (``weight.new_zeros(nlayers, bsz, nhid)``), dropout (off in
eval), a decoder tied to the embedding, ``log_softmax`` over the flattened ``[T * B, V]``.
Called as the zoo calls models (``idx [B, T]`` in, ``[B, T, V]`` out): the adapter transposes
around the repository's own ``forward(input, hidden)``. Also two layers the tree cannot follow:
a bidirectional LSTM, and an LSTM whose final state is read (added to every position).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from zoo_repos.common import VOCAB

NINP = NHID = 24


class RNNModel(nn.Module):
    def __init__(self, rnn_type: str = "LSTM", nlayers: int = 2, dropout: float = 0.2, tie_weights: bool = True,
                 bidirectional: bool = False, read_final: bool = False) -> None:
        super().__init__()
        self.ntoken, self.rnn_type, self.nhid, self.nlayers = VOCAB, rnn_type, NHID, nlayers
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(VOCAB, NINP)
        if rnn_type in ("LSTM", "GRU"):
            self.rnn = getattr(nn, rnn_type)(NINP, NHID, nlayers, dropout=dropout, bidirectional=bidirectional)
        else:
            nonlinearity = {"RNN_TANH": "tanh", "RNN_RELU": "relu"}[rnn_type]
            self.rnn = nn.RNN(NINP, NHID, nlayers, nonlinearity=nonlinearity, dropout=dropout)
        dirs = 2 if bidirectional else 1
        self.decoder = nn.Linear(dirs * NHID, VOCAB)
        if tie_weights and dirs == 1:
            self.decoder.weight = self.encoder.weight
        self.read_final = read_final

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        dirs = 2 if self.rnn.bidirectional else 1
        shape = (self.nlayers * dirs, bsz, self.nhid)
        if self.rnn_type == "LSTM":
            return weight.new_zeros(shape), weight.new_zeros(shape)
        return weight.new_zeros(shape)

    def step(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        if self.read_final:
            output = output + hidden[0][-1]
        decoded = self.decoder(self.drop(output)).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def forward(self, idx):
        b, t = idx.shape
        out, _ = self.step(idx.t(), self.init_hidden(b))
        return out.view(t, b, self.ntoken).transpose(0, 1)
