"""Reading trajectories: files, datasets and the bundled samples.

`io` reads and writes tree files (JSONL, JSON), `datasets` reads Hugging Face datasets,
`samples` opens the real public samples shipped in ``treecompile/samples/`` (trees from chat
conversations are `treecompile.chat.to_tree`).

Layer 8: imports kernels and core (and the layers between, which it does not need).
"""

from treecompile.data.samples import *  # noqa: F401,F403  (``treecompile.data.sample_tau_bench``)
from treecompile.data.samples import __all__  # noqa: F401
