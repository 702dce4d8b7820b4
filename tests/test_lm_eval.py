"""A real eval client (issue 31, item 6): lm-evaluation-harness runs a small multiple-choice
task (tests/data/lm_eval: 6 items, offline) through its `local-completions` model against a
live speculating server on 127.0.0.1 (completions with `echo` + `logprobs`), and its scores
equal the ones computed here from plain decoding's prompt logprobs of the target.
lm-eval is in the `eval` extra (and `dev`); without it this test skips."""

from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")

from fixtures import load_named_pool  # noqa: E402

from specrouter.config import SamplingParams  # noqa: E402
from specrouter.engine.engine import Engine  # noqa: E402
from specrouter.server import ServerConfig, create_app  # noqa: E402
from specrouter.server.live import LiveServer  # noqa: E402

DATA = Path(__file__).parent / "data" / "lm_eval"
NAMES = ("target", "mid")


def plain_loglikelihood(engine, tok, context: str, continuation: str) -> float:
    """lm-eval's encoding of a (context, continuation) pair (TemplateLM._encode_pair: trailing
    spaces of the context go to the continuation; the continuation's tokens are the whole's
    after the context's), scored by plain decoding's prompt logprobs."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = tok(context, add_special_tokens=False)["input_ids"]
    seq = engine.generate_ids([whole], [SamplingParams(max_new_tokens=1, prompt_logprobs=1)],
                              chain=("target",))[0]
    return sum(e.logprob for e in seq.prompt_logprobs[len(ctx) - 1:])


def test_lm_eval_local_completions_matches_plain_decoding(tiny_pool_dirs, monkeypatch, tmp_path):
    import json

    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.chdir(DATA)  # the task's data_files path is relative
    cfg = ServerConfig(chain=("ngram", "mid", "target"), k=3, max_num_seqs=2, max_model_len=256)
    pool = load_named_pool(tiny_pool_dirs, NAMES, dtype="float32")
    with LiveServer(create_app(load_named_pool(tiny_pool_dirs, NAMES, dtype="float32"), cfg)) as srv:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"model": "target", "base_url": srv.base_url + "/completions",
                        "tokenizer_backend": "huggingface", "tokenizer": str(tiny_pool_dirs["target"]),
                        "num_concurrent": 1, "max_retries": 1, "max_length": 256},
            tasks=["specrouter_mc"], task_manager=TaskManager(include_path=str(DATA)),
            log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    samples = results["samples"]["specrouter_mc"]
    assert len(samples) == 6
    engine, tok = Engine(pool), pool.tokenizer
    correct = []
    for s in samples:
        got = [r[0][0] for r in s["resps"]]  # lm-eval's (loglikelihood, is_greedy) per choice
        want = [plain_loglikelihood(engine, tok, *a) for a in s["arguments"]]
        assert got == want  # the same floats: the target's prefill logits, summed in the same order
        correct.append(max(range(len(want)), key=want.__getitem__) == s["target"])
    score = results["results"]["specrouter_mc"]["acc,none"]
    assert score == sum(correct) / len(correct)
    json.dumps(results["results"])  # a normal result
