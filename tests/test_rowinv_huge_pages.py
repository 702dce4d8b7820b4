"""The native runner's packed weights on huge pages (runners/huge_pages.py): copies of the same
bytes, so every logit bit stays; and they are on huge pages where the kernel allows them."""

from pathlib import Path

import pytest
import torch

from fixtures import make_tiny_llama
from specrouter.models.runners import huge_pages
from specrouter.models.runners.base import ForwardBatch
from specrouter.models.runners.huge_pages import huge_page_bytes, huge_page_copies
from specrouter.models.runners.kernels import why_not_native
from specrouter.models.runners.llama import load_llama_runner

pytestmark = pytest.mark.skipif(why_not_native() is not None, reason=str(why_not_native()))
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The system's transparent huge page mode (always / madvise / never), None if unknown."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else None


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # a head of 8192 x 128 float32 (4 MiB): over a huge page whatever the arena's alignment
    return make_tiny_llama(tmp_path_factory.mktemp("huge") / "m", vocab_size=8192, hidden_size=128,
                           num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384,
                           with_tokenizer=False)


def _steps(runner) -> list[torch.Tensor]:
    """Logits of a prefill, a 1-token step and a 5-token verification after it."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, runner.vocab_size, (40,), generator=g).tolist()
    out = [runner.forward(ForwardBatch.build([0], [0], [prompt], [list(range(40))]))]
    for t in (1, 5):
        out.append(runner.forward(ForwardBatch.build([0], [40], [prompt[:t]], [list(range(t))])))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_weights_on_huge_pages_give_the_same_bits(ckpt, dtype, monkeypatch):
    on = load_llama_runner(ckpt, dtype=dtype, max_len=64)
    monkeypatch.setattr(huge_pages, "HUGE_PAGES", False)
    off = load_llama_runner(ckpt, dtype=dtype, max_len=64)
    # moved: the layers' linears (the fused stack's params too) and the head are copies
    assert on._head.weight.data_ptr() != off._head.weight.data_ptr()
    assert on._fused[0][1].data_ptr() == on._layers[0][1].weight.data_ptr()
    for a, b in zip(_steps(on), _steps(off)):
        assert torch.equal(a, b)


def test_copies_hold_the_bytes_in_order_and_sit_on_huge_pages():
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(1000, 517, generator=g), torch.randn(3, 5, generator=g).to(torch.bfloat16),
          torch.randn(2048, 640, generator=g)]
    copies = huge_page_copies(ts)
    assert all(torch.equal(a, b) and a.dtype == b.dtype and a.data_ptr() != b.data_ptr() for a, b in zip(ts, copies))
    ptrs = [c.data_ptr() for c in copies]
    assert ptrs == sorted(ptrs) and ptrs[0] % huge_pages.HUGE == 0 and all(p % 4096 == 0 for p in ptrs)
    copies[1].fill_(0)  # each copy its own bytes
    assert torch.equal(copies[0], ts[0]) and torch.equal(copies[2], ts[2])
    if _thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {_thp_mode() or 'unknown'} here ({THP})")
    assert huge_page_bytes(copies[0]) >= huge_pages.HUGE, "the arena is not on huge pages"
    if _thp_mode() == "madvise":  # the control: torch's own allocation, never advised
        assert huge_page_bytes(ts[0]) < huge_page_bytes(copies[0])


def test_switched_off_the_tensors_stay_where_they_are(monkeypatch):
    t = torch.randn(64, 64)
    monkeypatch.setattr(huge_pages, "HUGE_PAGES", False)
    assert huge_page_copies([t])[0] is t
