import os
import tempfile

import pytest
import torch

# Converted models, cost profiles and assembled drafts go to a throw-away cache, never ~/.cache.
os.environ.setdefault("SPECROUTER_CACHE", tempfile.mkdtemp(prefix="specrouter-test-cache-"))

# Without a GPU, the runner's Triton kernels (models/runners/triton/) run in Triton's interpreter
# on CPU tensors; it is chosen when a kernel is defined, so before any of them is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_dot_in_fixed_order():
    """The interpreter runs `tl.dot` as numpy's matmul, i.e. the CPU's BLAS, whose sgemm is not
    invariant to a row's place in a block on every CPU (OpenBLAS's Zen kernel: rows 6-15 of a
    16-row block take another micro-kernel than rows 0-5, so a row's bits change when it moves).
    A GPU's MMA on a fixed tile has no such dependence, and that is what the Triton kernels rely
    on: the interpreter's dot is made one fixed-order sum over K per output (float32 products
    summed in K order, the same for every row), so the tests check the kernels' tiling, masking
    and K loop, not the host BLAS."""
    import numpy as np

    try:
        from triton.runtime import interpreter
    except ImportError:  # no triton: its tests are skipped
        return
    builder = interpreter.InterpreterBuilder
    plain_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc = d.data
        if a.data.dtype != np.float32 or b.data.dtype != np.float32 or acc.dtype != np.float32:
            return plain_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = acc.copy()  # (M, N)
        for k in range(a.data.shape[-1]):  # (M, 1) * (1, N): one product per output, K in order
            out += a.data[:, k : k + 1] * b.data[k : k + 1, :]
        return interpreter.TensorHandle(out, d.dtype.scalar)

    builder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_dot_in_fixed_order()

# Tests are small; one thread keeps them deterministic in time on a 2-core CI machine.
torch.set_num_threads(int(os.environ.get("SPECROUTER_TEST_THREADS", "1")))


@pytest.fixture(autouse=True, scope="session")
def _sigint_as_in_a_terminal():
    """Ctrl-C as a terminal delivers it, whatever started pytest: a test run started in the
    background by a non-interactive shell (`cmd &`) inherits SIGINT *ignored*, and so would the
    servers and CLIs the tests spawn; the Ctrl-C tests (a raised SIGINT, or one sent to a child)
    then failed only there. Python's default handler here; children start with the default."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def near_tie_pool_dirs(tmp_path_factory):
    """fixtures.make_near_tie_pool's float32 target/mid/draft (256 positions), built once for the
    tree tests that share it."""
    from fixtures import make_near_tie_pool

    return make_near_tie_pool(tmp_path_factory.mktemp("neartie"), max_position_embeddings=256)


@pytest.fixture(scope="session")
def tiny_pool_dirs(tmp_path_factory):
    """Tiny float64 Llama-family checkpoints sharing one tokenizer:
    target, a mid verifier (target + 10% noise), a draft (target + 40% noise), a "same" draft
    (exact copy), and a "random" draft (independent weights)."""
    from fixtures import make_tiny_llama

    root = tmp_path_factory.mktemp("pool")
    d = torch.float64
    # untied embeddings: tied random models mostly repeat their input token, a degenerate test
    target = make_tiny_llama(root / "target", hidden_size=64, num_layers=3, seed=1, dtype=d, tie_word_embeddings=False)
    return {
        "target": target,
        "mid": make_tiny_llama(root / "mid", hidden_size=64, num_layers=3, seed=2, init_from=target, noise=0.1, dtype=d, tie_word_embeddings=False),
        "draft": make_tiny_llama(root / "draft", hidden_size=64, num_layers=3, seed=3, init_from=target, noise=0.4, dtype=d, tie_word_embeddings=False),
        "same": make_tiny_llama(root / "same", hidden_size=64, num_layers=3, seed=4, init_from=target, noise=0.0, dtype=d, tie_word_embeddings=False),
        "random": make_tiny_llama(root / "random", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, seed=5, dtype=d, tie_word_embeddings=False),
    }
