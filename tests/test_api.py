"""The Python API and the CLI on tiny checkpoints: results, stats and clear errors."""

import shutil

import pytest
from fixtures import make_tiny_llama

from specrouter import (
    ChainError,
    CheckpointError,
    ContextLengthError,
    SamplingParamsError,
    SpecRouter,
    VocabularyMismatchError,
)
from specrouter.cli.main import main


@pytest.fixture(scope="module")
def sr(tiny_pool_dirs):
    d = tiny_pool_dirs
    return SpecRouter.from_pretrained([d["draft"], d["target"]], target="target", dtype="float64")


def test_generate_text_batch_and_stats(sr):
    out = sr.generate(["def add(a, b):", "The quick brown fox"], max_new_tokens=12,
                      chain=("ngram", "draft", "target"), k=3, ignore_eos=True)
    assert len(out) == 2
    for r in out:
        assert len(r.token_ids) == 12 and r.finish_reason == "length"
        assert r.text == sr.tokenizer.decode(r.token_ids, skip_special_tokens=True)
        s = r.stats.as_dict()
        assert s["generated_tokens"] == 12 and s["cycles"] >= 1
        assert set(s["chains"]) <= {"ngram>draft>target", "target"}
        assert s["tokens_per_second"] > 0
    single = sr.generate("def add(a, b):", max_new_tokens=12, ignore_eos=True)
    assert single[0].token_ids == out[0].token_ids  # default chain, same greedy output


def test_chat_prompt_uses_template(sr):
    msgs = [{"role": "user", "content": "hi"}]
    ids = sr.encode(msgs)
    assert ids == sr.encode("hi", chat=True)
    assert sr.tokenizer.decode(ids).startswith("<|im_start|>user")


def test_invalid_sampling_parameters(sr):
    for kw in [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2),
               dict(max_new_tokens=0), dict(temperature=float("nan"))]:
        with pytest.raises(SamplingParamsError):
            sr.generate("hello", **kw)


def test_invalid_chain_and_k(sr):
    with pytest.raises(ChainError, match="end at the target"):
        sr.generate("hello", chain=("target", "draft"))
    with pytest.raises(ChainError, match="unknown"):
        sr.generate("hello", chain=("nope", "target"))
    with pytest.raises(ChainError, match="draft length"):
        sr.generate("hello", k=0)
    with pytest.raises(ChainError, match="draft length"):
        sr.generate("hello", k=17)


def test_prompt_longer_than_context(sr):
    with pytest.raises(ContextLengthError, match="context"):
        sr.generate([5] * 600, max_new_tokens=4)  # tiny models have 512 positions
    # the engine is still usable afterwards
    assert len(sr.generate("hello", max_new_tokens=3, ignore_eos=True)[0].token_ids) == 3


def test_missing_and_corrupt_checkpoints(tmp_path, tiny_pool_dirs):
    with pytest.raises(CheckpointError, match="does not exist"):
        SpecRouter.from_pretrained([tmp_path / "missing"])
    broken = tmp_path / "broken"
    shutil.copytree(tiny_pool_dirs["draft"], broken)
    (broken / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError):
        SpecRouter.from_pretrained([broken])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        SpecRouter.from_pretrained([empty])


def test_vocabularies_must_match(tmp_path, tiny_pool_dirs):
    other = make_tiny_llama(tmp_path / "othervocab", vocab_size=300, seed=9)
    with pytest.raises(VocabularyMismatchError, match="othervocab"):
        SpecRouter.from_pretrained([other, tiny_pool_dirs["target"]])


def test_cli_generate_compare(tiny_pool_dirs, capsys):
    d = tiny_pool_dirs
    rc = main(["generate", "--models", str(d["draft"]), str(d["target"]), "--target", "target",
               "--prompt", "def add(a, b):", "--max-new-tokens", "8", "--chain", "draft", "target",
               "--k", "3", "--compare", "--dtype", "float64"])
    captured = capsys.readouterr()
    assert rc == 0
    assert captured.out.strip()  # the text on stdout, the statistics on stderr
    assert "greedy output identical: True" in captured.err
    assert "chain draft>target" in captured.err


def test_cli_reports_errors_cleanly(tmp_path, capsys):
    rc = main(["generate", "--models", str(tmp_path / "nope"), "--prompt", "x"])
    assert rc == 2
    assert "does not exist" in capsys.readouterr().err
