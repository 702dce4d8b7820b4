"""Tiny random checkpoints for tests, benchmarks and the pre-release demo pool, and the helpers
tests share (a pool or router of named checkpoints, repeating prompts, a server subprocess).

Everything here builds real Hugging Face checkpoint directories (config.json + safetensors +
tokenizer.json) with `save_pretrained`, so loaders are exercised exactly as on real models.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

_CORPUS = (
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"
    "        self.x = x\n        self.y = y\n\n"
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens with a small "
    "model and verifies them with a large one, so the output stays exactly the same.\n"
    "User: What is the capital of France?\nAssistant: The capital of France is Paris.\n"
) * 4


def make_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 320) -> int:
    """Train a byte-level BPE tokenizer of about `vocab_size` tokens and save it (tokenizer.json
    + tokenizer_config.json). Returns the real vocabulary size. Deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(str(out_dir))
    return len(fast)


def make_tiny_llama(
    out_dir: str | Path,
    *,
    vocab_size: int = 320,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    model_type: str = "llama",
    tie_word_embeddings: bool = True,
    rope_scaling: dict | None = None,
    seed: int = 0,
    init_from: str | Path | None = None,
    noise: float = 0.0,
    dtype: torch.dtype = torch.float32,
    with_tokenizer: bool = True,
) -> Path:
    """Save a random Llama-family checkpoint (llama / qwen2 / mistral) with a tiny tokenizer.

    `init_from` + `noise` make a model that copies another checkpoint's weights and adds
    Gaussian noise of relative size `noise` (a "similar" draft: noise=0 gives the same model).
    """
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    real_vocab = make_tiny_tokenizer(out, vocab_size) if with_tokenizer else vocab_size
    vocab_size = max(vocab_size, real_vocab)
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size + hidden_size // 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=0,
        eos_token_id=0,
        rms_norm_eps=1e-5,
    )
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[model_type]
    config = cls[0](**kwargs)
    torch.manual_seed(seed)
    model = cls[1](config)
    with torch.no_grad():
        # random init of transformers is small; widen it so random models are not near-uniform
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.02)
        if init_from is not None:
            src = cls[1].from_pretrained(str(init_from), dtype=torch.float32)
            src_params = dict(src.named_parameters())
            for name, p in model.named_parameters():
                base = src_params[name].detach()
                p.copy_(base + noise * base.std() * torch.randn_like(base))
    model.to(dtype).save_pretrained(str(out))
    (out / "specrouter_test.json").write_text(json.dumps({"seed": seed, "noise": noise}))
    return out


# -- helpers tests share -----------------------------------------------------------------------
TINY_POOL = ("target", "mid", "draft", "same", "random")  # conftest's tiny_pool_dirs, target first


def load_named_pool(dirs: dict, names, dtype: str = "float64", **kwargs):
    """A `Pool` of `dirs[n]` for each of `names`, named so, "target" the target."""
    from specrouter.models.pool import Pool

    return Pool.load([dirs[n] for n in names], names=list(names), target="target", dtype=dtype,
                     **kwargs)


def named_router(dirs: dict, names, dtype: str = "float64", **kwargs):
    """A `SpecRouter` of `dirs[n]` for each of `names`, named so, "target" the target."""
    from specrouter import SpecRouter

    return SpecRouter.from_pretrained([dirs[n] for n in names], names=list(names), target="target",
                                      dtype=dtype, **kwargs)


FOUR_LEVELS = ("target", "mid", "draft", "same")  # the tiny pool's levels the chain tests run


def four_level_fixtures(prompt_lengths=(6, 11, 17)):
    """Module-scoped `pool` (FOUR_LEVELS of the session's tiny checkpoints, float64) and
    `prompts` (repeating prompts of `prompt_lengths`) fixtures, for a test module to bind:
    `pool, prompts = four_level_fixtures()`."""
    import pytest

    @pytest.fixture(scope="module", name="pool")
    def pool(tiny_pool_dirs):
        return load_named_pool(tiny_pool_dirs, FOUR_LEVELS)

    @pytest.fixture(scope="module", name="prompts")
    def prompts():
        return repeating_prompts(prompt_lengths)

    return pool, prompts


def generated_ids(sr, prompts, max_new_tokens: int, **kw) -> list[list[int]]:
    """Each prompt's generated token ids (EOS ignored, so every row runs max_new_tokens)."""
    return [r.token_ids for r in sr.generate(prompts, max_new_tokens=max_new_tokens, ignore_eos=True, **kw)]


def repeating_prompts(lengths, seed: int = 0) -> list[list[int]]:
    """Token prompts of these lengths, each a random fragment repeated (so the n-gram drafter
    has something to find)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        base = torch.randint(3, 300, (max(2, n // 2),), generator=g).tolist()
        out.append((base * 3)[:n])
    return out


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(proc: subprocess.Popen, port: int, timeout: float, what: str) -> int:
    """Polls /health on 127.0.0.1:`port` until the server `proc` answers; returns the status (an
    error status too: /health may want a key). Fails when `proc` exits or after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            out = proc.stdout.read()
            raise AssertionError((out.decode() if isinstance(out, bytes) else out)[-3000:])
        assert time.monotonic() < deadline, f"{what} did not come up"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as e:  # up: it answered
            return e.code
        except OSError:
            time.sleep(0.2)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT, then a kill after 30 s; closes its stdout."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    proc.stdout.close()


class QuietRouterHooks:
    """`RouterProtocol` for scripted routers that only `decide` each row: plan_batch asks
    decide() row by row; nothing is learned."""

    step_clock = None
    measure_tv = False
    tv_positions = 2

    def plan_batch(self, rows, pinned=()):
        from specrouter.records.routing import BatchPlan

        return BatchPlan([self.decide(r) for r in rows])

    def take_confident_drafts(self, rows, plans, offers, pinned=()):
        return plans

    def observe_step(self, report):
        pass

    def finish_request(self, seq_id):
        pass

    def mark_failed(self, model):
        pass


def make_near_tie_pool(root: str | Path, *, max_position_embeddings: int) -> dict[str, Path]:
    """float32 checkpoints whose target logits sit close together (its head scaled by 0.05: near
    ties, so one differing bit flips an argmax), with a mid and a draft initialised from it."""
    from safetensors.torch import load_file, save_file

    root = Path(root)
    kw = dict(hidden_size=64, num_layers=3, tie_word_embeddings=False, max_position_embeddings=max_position_embeddings)
    target = make_tiny_llama(root / "target", seed=1, **kw)
    f = target / "model.safetensors"
    tensors = load_file(str(f))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 0.05
    save_file(tensors, str(f), metadata={"format": "pt"})
    return {
        "target": target,
        "mid": make_tiny_llama(root / "mid", seed=2, init_from=target, noise=0.1, **kw),
        "draft": make_tiny_llama(root / "draft", seed=3, init_from=target, noise=0.4, **kw),
    }


def iid_cycle(rng, chain, k: int, alphas, ngram_hit: float) -> tuple[list[int], list[int]]:
    """One row's cycle of the iid acceptance model for router simulations: per level of `chain`,
    the tokens it was offered (`drafted`) and accepted. An n-gram drafter finds a match with
    probability `ngram_hit` (else it drafts nothing); each level accepts every offered token with
    its pair's alpha until its first rejection, and passes up what it accepted plus one token."""
    n = len(chain)
    drafted, accepted = [0] * n, [0] * n
    if n == 1:
        return drafted, accepted
    m = k if chain[0] != "ngram" or rng.random() < ngram_hit else 0
    drafted[0] = m
    for j in range(1, n):
        a = 0
        while a < m and rng.random() < alphas[(chain[j - 1], chain[j])]:
            a += 1
        drafted[j], accepted[j] = m, a
        m = a + 1
    return drafted, accepted
